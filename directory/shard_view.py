"""What one replica knows of the shard map, and whether its group owns a key.

Pure (no I/O, no clock, no protobuf): `ShardView` keeps the newest map the
replica has seen (versions only go up) and answers the check that every keyed
request passes (`check`); the I/O that feeds it is in shard_service.py.

Cost on the request path: a replica that owns every key (unsharded, or its
group holds the whole space) pays one attribute test per request. Otherwise
each hash costs one blake2b-64 and an interval test against the group's own
ranges, merged where adjacent (one range for an even map).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvdir.core.shard_map import KEY_SPACE, MOVING, ShardMap

HOME_GROUP = "g0"
"""The group whose Raft log holds the shard map (docs/sharding.md)."""


class NoShardMap(Exception):
    """A sharded replica has no map yet: it cannot tell what it owns."""


class WrongShard(Exception):
    """A request names a key another group owns under this replica's map."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


_key8 = functools.partial(hashlib.blake2b, digest_size=8)
"""A hash's routing key as 8 big-endian bytes (`shard_key` before its int)."""
_END = b"\xff" * 9
"""Above every 8-byte key: 2**64 as a bound (bytes compare as unsigned big-endian)."""


def _bound(key: int) -> bytes:
    return _END if key >= KEY_SPACE else key.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class Ownership:
    """One map seen from one group: the key ranges it owns, merged, as
    8-byte bounds (comparing digests as bytes skips an int per hash)."""

    shard_map: ShardMap
    group_id: str
    all_keys: bool
    los: tuple[bytes, ...]
    his: tuple[bytes, ...]
    bounds: tuple[bytes, ...]
    """lo0, hi0, lo1, hi1, ...: strictly increasing (adjacent ranges are merged)."""

    @classmethod
    def of(cls, m: ShardMap, group_id: str) -> Ownership:
        ranges: list[list[int]] = []
        for s in m.shards:  # sorted and contiguous (the map's invariant)
            if s.group_id != group_id:
                continue
            if ranges and ranges[-1][1] == s.lo:
                ranges[-1][1] = s.hi
            else:
                ranges.append([s.lo, s.hi])
        whole = ranges == [[0, KEY_SPACE]]
        los = tuple(_bound(r[0]) for r in ranges)
        his = tuple(_bound(r[1]) for r in ranges)
        bounds = tuple(b for pair in zip(los, his, strict=True) for b in pair)
        return cls(m, group_id, whole, los, his, bounds)

    def first_foreign(self, hashes: Sequence[bytes]) -> int:
        """Index of the first hash whose key this group does not own, or -1."""
        if self.all_keys:
            return -1
        if len(self.los) == 1:  # the usual case: one range, two compares per hash
            lo, hi = self.los[0], self.his[0]
            if all(lo <= _key8(h).digest() < hi for h in hashes):
                return -1
        else:  # a key is owned iff an odd number of bounds are <= it: no call per hash
            bounds, right = self.bounds, bisect.bisect_right
            if all(right(bounds, _key8(h).digest()) & 1 for h in hashes):
                return -1
        # A refusal: find which one (the slow path costs only refused requests).
        return next(i for i, h in enumerate(hashes) if not self._owns(_key8(h).digest()))

    def _owns(self, key: bytes) -> bool:
        j = bisect.bisect_right(self.los, key) - 1
        return j >= 0 and key < self.his[j]


def handover_error(old: ShardMap | None, new: ShardMap) -> str | None:
    """Why `new` may not follow `old`, or None.

    A key may change group only by finishing its move (`old` has its shard
    MOVING to the group that `new` names as the owner): any other change of
    owner would hide the entries the old group holds, losing acknowledged
    writes. Splits, merges of one group's shards, new groups, changed replica
    lists and starting or aborting a move keep every key's owner.
    """
    if old is None:
        return None
    i = j = 0
    lo = 0
    while lo < KEY_SPACE:
        o, n = old.shards[i], new.shards[j]
        moved = o.state == MOVING and n.group_id == o.target_group
        if n.group_id != o.group_id and not moved:
            return (
                f"keys [{lo}, {min(o.hi, n.hi)}) would pass from group {o.group_id!r} to "
                f"{n.group_id!r} without a finished move (shard {o.shard_id} is {o.state})"
            )
        lo = min(o.hi, n.hi)
        i += o.hi == lo
        j += n.hi == lo
    return None


class ShardView:
    """The newest map this replica knows, and the ownership check. Thread-safe:
    one lock-free read of an immutable `Ownership` per request."""

    def __init__(self, group_id: str, sharded: bool) -> None:
        self.group_id = group_id
        self.sharded = sharded
        self.home = sharded and group_id == HOME_GROUP
        self._lock = threading.Lock()
        self._own: Ownership | None = None

    @property
    def shard_map(self) -> ShardMap | None:
        own = self._own
        return None if own is None else own.shard_map

    @property
    def owns_all(self) -> bool:
        """Every key is this group's (unsharded, or a map giving it the whole space):
        the check has nothing to do."""
        own = self._own
        return not self.sharded or (own is not None and own.all_keys)

    @property
    def version(self) -> int:
        own = self._own
        return 0 if own is None else own.shard_map.version

    def offer(self, m: ShardMap) -> bool:
        """Keep `m` if it is newer than the map known; whether it was kept."""
        with self._lock:
            if self._own is not None and m.version <= self._own.shard_map.version:
                return False
            self._own = Ownership.of(m, self.group_id)
            return True

    def check(self, hashes: Sequence[bytes]) -> None:
        """Raise NoShardMap or WrongShard unless this group owns every hash."""
        if not self.sharded:
            return
        own = self._own
        if own is None:
            raise NoShardMap("no shard map yet: this replica has not heard from the home group")
        i = own.first_foreign(hashes)
        if i < 0:
            return
        m = own.shard_map
        s = m.shard_of(hashes[i])
        moving = f" (moving to {s.target_group})" if s.state == MOVING else ""
        raise WrongShard(
            f"block {hashes[i].hex()} is in shard {s.shard_id}, owned by group "
            f"{s.group_id!r}{moving} under shard map v{m.version}; this replica is in "
            f"group {self.group_id!r}: refresh the map and send it there",
            m.version,
        )


__all__ = ["HOME_GROUP", "NoShardMap", "Ownership", "ShardView", "WrongShard", "handover_error"]
