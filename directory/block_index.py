"""One namespace's map from block hash to the head slot of its holder chain, in shards.

CPython grows a dict by rehashing all of its keys in one call, holding the
GIL. With one dict per namespace, the insert that crossed a size threshold
stalled `Table.apply` for 123 ms at 1.4M blocks, 277 ms at 2.8M and 521 ms
at 5.6M (1,000-entry publishes on the 2-core bench host;
bench/results/apply-stalls-2026-12-02.md). A replica applies
on its Raft thread, so at that log index every replica stopped sending and
answering heartbeats for longer than the 150-300 ms election timeout, and
each mirror's lag jumped by the same stall. Split by the hash's last byte
into `SHARDS` dicts, a grow rehashes a 256th of the keys (the shards of
uniform digests cross their thresholds spread over tens of thousands of
inserts, one or two per publish), for one extra index per probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from operator import contains

SHARDS = 256
"""Shards per namespace: indexed by a hash's last byte, so exactly 256."""


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
            shards[key[-1]][key] = s
        return out

    def get(self, key: bytes, default: int) -> int:
        # An empty hash is never stored (publishes are validated): a miss, not an IndexError.
        return self._shards[key[-1]].get(key, default) if key else default

    def __getitem__(self, key: bytes) -> int:
        return self._shards[key[-1]][key]

    def __setitem__(self, key: bytes, slot: int) -> None:
        self._shards[key[-1]][key] = slot

    def __delitem__(self, key: bytes) -> None:
        del self._shards[key[-1]][key]

    def __contains__(self, key: bytes) -> bool:
        return bool(key) and key in self._shards[key[-1]]

    def isdisjoint(self, keys: Iterable[bytes]) -> bool:
        """None of `keys` is in the index (every key non-empty)."""
        shards = self._shards
        keys = list(keys)
        # One list of shards, then a C-level map: half the time of a generator.
        return not any(map(contains, [shards[k[-1]] for k in keys], keys))

    def add_run(self, keys: Sequence[bytes], start: int) -> None:
        """keys[i] -> start + i for every i (a fresh publish's consecutive slots)."""
        shards = self._shards
        for key, s in zip(keys, range(start, start + len(keys)), strict=True):
            shards[key[-1]][key] = s

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

    def part(self, i: int) -> dict[bytes, int]:
        """Shard `i` itself (a chunked scan: `Table` drops a moved shard a part at a time)."""
        return self._shards[i]

    def items(self) -> Iterator[tuple[bytes, int]]:
        return chain.from_iterable(d.items() for d in self._shards)
