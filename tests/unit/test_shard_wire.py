"""The shard map at the wire (kvdir.core.shard_wire): both ways, and refusals."""

from __future__ import annotations

import pytest

from kvdir.core import shard_wire
from kvdir.core.shard_map import KEY_SPACE, Group, ShardMapError, even_map
from kvdir.v1 import directory_pb2 as pb

GROUPS = (Group("g0", ("127.0.0.1:1", "127.0.0.1:2")), Group("g1", ("127.0.0.1:3",)))


def test_round_trip_keeps_every_field_and_the_top_of_the_space() -> None:
    m = even_map(GROUPS, shards_per_group=2).with_split(0, 9).with_move_started(9, "g1")
    msg = shard_wire.to_pb(m)
    assert msg.shards[-1].hi == 0  # 2**64 travels as 0
    back = shard_wire.from_pb(pb.ShardMap.FromString(msg.SerializeToString()))
    assert back == m
    assert back.shards[-1].hi == KEY_SPACE
    assert back.to_json() == m.to_json()


def test_a_broken_map_is_refused_with_a_message() -> None:
    msg = shard_wire.to_pb(even_map(GROUPS, shards_per_group=2))
    msg.shards[1].lo += 1  # a gap
    with pytest.raises(ShardMapError, match="without gaps"):
        shard_wire.from_pb(msg)
    msg = shard_wire.to_pb(even_map(GROUPS))
    msg.shards[0].state = pb.SHARD_STATE_UNSPECIFIED
    with pytest.raises(ShardMapError, match="no valid state"):
        shard_wire.from_pb(msg)
    with pytest.raises(ShardMapError):
        shard_wire.from_pb(pb.ShardMap())  # version 0, nothing in it


def test_version_of_metadata() -> None:
    key = shard_wire.SHARD_MAP_VERSION_KEY
    assert shard_wire.version_of(None) == 0
    assert shard_wire.version_of([("other", "5")]) == 0
    assert shard_wire.version_of([(key, "17")]) == 17
    assert shard_wire.version_of([(key, b"3")]) == 3
    assert shard_wire.version_of([(key, "-1")]) == 0
    assert shard_wire.version_of([(key, "9" * 40)]) == 0
