"""One namespace's map from block hash to the head slot of its holder chain, in shards.

CPython grows a dict by rehashing all of its keys in one call, holding the
GIL. With one dict per namespace, the insert that crossed a size threshold
stalled `Table.apply` for 123 ms at 1.4M blocks, 277 ms at 2.8M and 521 ms
at 5.6M (1,000-entry publishes on the 2-core bench host;
bench/results/apply-stalls-2026-12-02.md). A replica applies on its Raft
thread, so at that log index every replica stopped sending and answering
heartbeats for longer than the 150-300 ms election timeout, and each
mirror's lag jumped by the same stall. So the index is `SHARDS` dicts and a
grow rehashes one shard.

Shards of equal expected size would all cross their thresholds within the
same few publishes: with 256 equal shards, the 256 grows due near 2.8M
blocks landed in about 100 publishes, and on the bench host those publishes
took up to 46 ms each on every replica and mirror at once (the mirror lag
p99 at 100k entries/s went from 17-21 ms just before and after that window
to 340-700 ms inside it). So the shards are unequal on purpose: shard i
takes a share of the hash space proportional to 2^(i/256), the sizes span
one doubling, and at any table size the grows are spread evenly over the
blocks it takes to double: one grow per 11 publishes of 1,000 blocks at
2.8M, each of one shard. A key's shard is read from its last two bytes (`shard_of`); a
digest's bytes are uniform, so the shares hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from operator import contains, itemgetter, setitem

import numpy as np

SHARDS = 256
"""Shards per namespace (each a dict)."""


def _shard_table() -> bytes:
    """The shard of each 16-bit suffix value: shard i owns a run of values whose
    length is proportional to 2^(i/SHARDS), 65,536 in all."""
    weights = [2 ** (i / SHARDS) for i in range(SHARDS)]
    scale = 65_536 / sum(weights)
    ends = [round(scale * sum(weights[: i + 1])) for i in range(SHARDS)]
    out = bytearray()
    start = 0
    for i, end in enumerate(ends):
        out += bytes((i,)) * (end - start)
        start = end
    assert len(out) == 65_536
    return bytes(out)


_SHARD_OF = _shard_table()
_SHARD_OF_NP = np.frombuffer(_SHARD_OF, dtype=np.uint8)


def shard_of(key: bytes) -> int:
    """The shard of a non-empty key: by its last two bytes (little-endian), or its one byte."""
    return _SHARD_OF[key[-2] | key[-1] << 8 if len(key) > 1 else key[0]]


def shards_of(keys: Sequence[bytes], widths: set[int]) -> list[int]:
    """`shard_of` of every key; `widths` is the set of their lengths. Keys of one
    even width (every engine's) take a C-level path over their concatenation."""
    if len(widths) == 1:
        (w,) = widths
        if w % 2 == 0 and keys:
            suffixes = np.frombuffer(b"".join(keys), dtype="<u2")[w // 2 - 1 :: w // 2]
            out: list[int] = _SHARD_OF_NP[suffixes].tolist()
            return out
    return list(map(shard_of, keys))


class BlockIndex:
    """hash -> head slot, for one namespace (the subset of `dict` the table uses).

    Iteration is shard by shard, each in insertion order: deterministic for a
    given command sequence, as replicas and snapshots need."""

    __slots__ = ("_shards",)

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int]] = [{} for _ in range(SHARDS)]

    @classmethod
    def of(cls, keys: Sequence[bytes | None], heads: Iterable[int]) -> BlockIndex:
        """The index of head slots `heads`, keyed by `keys[slot]` (a snapshot's restore)."""
        out = cls()
        shards = out._shards
        for s in heads:
            key = keys[s]
            assert key is not None, "a head slot is free"
            shards[shard_of(key)][key] = s
        return out

    def get(self, key: bytes, default: int) -> int:
        # An empty hash is never stored (publishes are validated): a miss, not an IndexError.
        return self._shards[shard_of(key)].get(key, default) if key else default

    def __getitem__(self, key: bytes) -> int:
        return self._shards[shard_of(key)][key]

    def __setitem__(self, key: bytes, slot: int) -> None:
        self._shards[shard_of(key)][key] = slot

    def __delitem__(self, key: bytes) -> None:
        del self._shards[shard_of(key)][key]

    def __contains__(self, key: bytes) -> bool:
        return bool(key) and key in self._shards[shard_of(key)]

    def _dicts(self, where: Sequence[int]) -> Sequence[dict[bytes, int]]:
        """The shard dict of each index in `where` (one C-level call)."""
        if len(where) == 1:
            return [self._shards[where[0]]]
        got: Sequence[dict[bytes, int]] = itemgetter(*where)(self._shards) if where else ()
        return got

    def isdisjoint(self, keys: Sequence[bytes], where: Sequence[int]) -> bool:
        """None of `keys` is in the index; `where` is `shards_of(keys)`."""
        return not any(map(contains, self._dicts(where), keys))

    def add_run(self, keys: Sequence[bytes], start: int, where: Sequence[int]) -> None:
        """keys[i] -> start + i for every i (a fresh publish's consecutive slots);
        `where` is `shards_of(keys)`."""
        assert len(where) == len(keys)
        deque(map(setitem, self._dicts(where), keys, range(start, start + len(keys))), maxlen=0)

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def __iter__(self) -> Iterator[bytes]:
        return chain.from_iterable(self._shards)

    def values(self) -> list[int]:
        """Every head slot, as one list (what a snapshot's capture stores)."""
        out: list[int] = []
        for d in self._shards:
            out.extend(d.values())
        return out

    def items(self) -> Iterator[tuple[bytes, int]]:
        return chain.from_iterable(d.items() for d in self._shards)
