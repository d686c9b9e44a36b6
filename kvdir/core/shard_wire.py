"""The shard map at the wire: kvdir.v1.ShardMap <-> `kvdir.core.shard_map.ShardMap`.

The one place that converts (the directory's server and every client use
it), so protobuf stays at the wire and the rest passes typed values. Also
the wire names of the sharded directory's contract (docs/sharding.md):
the refusal reason and the metadata key that carries a map version.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvdir.core.shard_map import (
    KEY_SPACE,
    MOVING,
    SERVING,
    Group,
    Shard,
    ShardMap,
    ShardMapError,
    ShardState,
)
from kvdir.v1 import directory_pb2 as pb

SHARD_MAP_VERSION_KEY = "kvdir-shard-map-version"
"""Metadata key: a map version (a replica's in a refusal's trailers; a client's
in its request metadata, so a replica behind it refreshes at once)."""
REASON_WRONG_SHARD = "wrong_shard"
"""`kvdir-reason` of a request naming a hash its replica's group does not own."""
REASON_NOT_HOME = "not_home"
"""`kvdir-reason` of a SetShardMap sent to a group that does not hold the map."""
REASON_STALE_VERSION = "stale_version"
"""`kvdir-reason` of a SetShardMap whose expected version is not the committed one."""
REASON_BAD_SHARD_MAP = "bad_shard_map"
"""`kvdir-reason` of a SetShardMap whose map breaks the map's invariants."""
REASON_NO_SHARD_MAP = "no_shard_map"
"""`kvdir-reason` of UNAVAILABLE from a sharded replica that has no map yet."""
REASON_SHARD_MOVING = "shard_moving"
"""`kvdir-reason` of a lookup naming a hash in a shard its group's log has fenced
(moving away, or still importing): for this call, that group's blocks are absent."""

_STATE_TO_PB = {SERVING: pb.SHARD_STATE_SERVING, MOVING: pb.SHARD_STATE_MOVING}
_STATE_FROM_PB: dict[int, ShardState] = {
    pb.SHARD_STATE_SERVING: SERVING,
    pb.SHARD_STATE_MOVING: MOVING,
}


def to_pb(m: ShardMap) -> pb.ShardMap:
    out = pb.ShardMap(version=m.version)
    for g in m.groups:
        out.groups.add(group_id=g.group_id, replicas=g.replicas)
    for s in m.shards:
        out.shards.add(
            shard_id=s.shard_id,
            lo=s.lo,
            hi=0 if s.hi == KEY_SPACE else s.hi,  # 2**64 does not fit a uint64
            group_id=s.group_id,
            state=_STATE_TO_PB[s.state],
            target_group=s.target_group,
        )
    return out


def from_pb(m: pb.ShardMap) -> ShardMap:
    """The map a message names; ShardMapError (a readable message) if it is not one."""
    return ShardMap(m.version, _groups(m.groups), tuple(_shard(s) for s in m.shards))


def _groups(groups: Iterable[pb.ShardGroup]) -> tuple[Group, ...]:
    return tuple(Group(g.group_id, tuple(g.replicas)) for g in groups)


def _shard(s: pb.ShardRange) -> Shard:
    state = _STATE_FROM_PB.get(s.state)
    if state is None:
        raise ShardMapError(f"shard {s.shard_id} has no valid state ({s.state})")
    hi = KEY_SPACE if s.hi == 0 else s.hi
    return Shard(s.shard_id, s.lo, hi, s.group_id, state, s.target_group)


def version_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The map version in gRPC metadata (0 when absent or not a number)."""
    for key, value in metadata or ():
        if key == SHARD_MAP_VERSION_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() and len(text) <= 20 else 0
    return 0


__all__ = [
    "REASON_BAD_SHARD_MAP",
    "REASON_NOT_HOME",
    "REASON_NO_SHARD_MAP",
    "REASON_SHARD_MOVING",
    "REASON_STALE_VERSION",
    "REASON_WRONG_SHARD",
    "SHARD_MAP_VERSION_KEY",
    "from_pb",
    "to_pb",
    "version_of",
]
