"""The move protocol's fences in a group's state machine (docs/sharding.md,
"Re-sharding online"): which key ranges this group has frozen (a shard moving
away: no more writes from the freeze's log index on) and which it is still
importing (a shard moving in: no client writes until ImportDone).

Pure data kept in the `Table` and its snapshots; the checks run at apply
time, in log order, so a client routing by a stale map cannot get a write
past a fence. A table with no fence pays one truth test per write.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdir.core.shard_map import KEY_SPACE

_key = functools.partial(hashlib.blake2b, digest_size=8)


def key_of(block_hash: bytes) -> int:
    """A hash's routing key (kvdir.core.shard_map.shard_key)."""
    return int.from_bytes(_key(block_hash).digest(), "big")


@dataclass(frozen=True, slots=True)
class Range:
    shard_id: int
    lo: int
    hi: int

    def holds(self, key: int) -> bool:
        return self.lo <= key < self.hi


@dataclass(slots=True)
class ShardFence:
    frozen: dict[int, Range] = field(default_factory=dict)
    importing: dict[int, Range] = field(default_factory=dict)
    drop_next: dict[int, int] = field(default_factory=dict)
    """Per frozen shard, the next block-index part its DropShard commands must name."""
    _los: list[int] = field(default_factory=list)
    _ranges: list[Range] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.frozen or self.importing)

    def _reindex(self) -> None:
        ranges = sorted([*self.frozen.values(), *self.importing.values()], key=lambda r: r.lo)
        self._ranges = ranges
        self._los = [r.lo for r in ranges]

    def overlaps(self, lo: int, hi: int) -> Range | None:
        """A fenced range sharing a key with [lo, hi), if any."""
        return next((r for r in self._ranges if r.lo < hi and lo < r.hi), None)

    def fenced(self, hashes: Sequence[bytes]) -> tuple[int, Range] | None:
        """(index, range) of the first hash in a fenced range, or None."""
        for i, h in enumerate(hashes):
            key = key_of(h)
            j = bisect.bisect_right(self._los, key) - 1
            if j >= 0 and self._ranges[j].holds(key):
                return i, self._ranges[j]
        return None

    def lookup_refusal(self, hashes: Sequence[bytes]) -> str | None:
        """Why a lookup of `hashes` must not be answered from this table: a block in a
        shard it has fenced (frozen: moving away, maybe partly dropped; or still
        importing), else None. Read under the table's lock, after any barrier: the
        replica's map may lag behind the move, its log does not (a linearizable read
        of a moved shard answered "absent" from a half-dropped table: the simulator
        of groups, seed 27)."""
        hit = self.fenced(hashes)
        if hit is None:
            return None
        r = hit[1]
        state = "moving away" if r.shard_id in self.frozen else "still importing"
        return f"shard {r.shard_id} is {state} on this group: ask its owner under a newer map"

    def freeze(self, r: Range) -> None:
        self.frozen[r.shard_id] = r
        self.drop_next[r.shard_id] = 0
        self._reindex()

    def begin_import(self, r: Range) -> None:
        self.importing[r.shard_id] = r
        self._reindex()

    def end_import(self, shard_id: int) -> None:
        del self.importing[shard_id]
        self._reindex()

    def drop(self, shard_id: int) -> None:
        del self.frozen[shard_id]
        del self.drop_next[shard_id]
        self._reindex()

    # -- snapshot form -----------------------------------------------------

    def to_json(self) -> dict[str, Any] | None:
        if not self:
            return None
        return {
            "frozen": [[r.shard_id, r.lo, r.hi] for r in self.frozen.values()],
            "drop_next": [[k, v] for k, v in self.drop_next.items()],
            "importing": [[r.shard_id, r.lo, r.hi] for r in self.importing.values()],
        }

    @staticmethod
    def from_json(d: Any) -> ShardFence:
        """From `to_json`'s form; ValueError on anything else."""
        f = ShardFence()
        if d is None:
            return f
        try:
            for kind, into in (("frozen", f.frozen), ("importing", f.importing)):
                for shard_id, lo, hi in d[kind]:
                    r = Range(int(shard_id), int(lo), int(hi))
                    if not 0 <= r.lo < r.hi <= KEY_SPACE:
                        raise ValueError(f"range [{r.lo}, {r.hi}) is not a key range")
                    into[r.shard_id] = r
            f.drop_next = {int(k): int(v) for k, v in d["drop_next"]}
            if set(f.drop_next) != set(f.frozen):
                raise ValueError("drop progress does not match the frozen shards")
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a shard fence: {e}") from e
        f._reindex()
        return f


__all__ = ["Range", "ShardFence", "key_of"]
