"""The shard map's routing and its changes (kvdir.core.shard_map)."""

from __future__ import annotations

import os

import pytest

from kvdir.core.shard_map import (
    KEY_SPACE,
    MOVING,
    SERVING,
    Group,
    Shard,
    ShardMap,
    ShardMapError,
    even_map,
    shard_key,
)

GROUPS = (
    Group("g0", ("127.0.0.1:1",)),
    Group("g1", ("127.0.0.1:2",)),
    Group("g2", ("127.0.0.1:3",)),
)


def test_even_map_covers_the_space_and_spreads_keys() -> None:
    m = even_map(GROUPS, shards_per_group=2)
    assert m.version == 1 and len(m.shards) == 6
    assert m.shards[0].lo == 0 and m.shards[-1].hi == KEY_SPACE
    # Sequential small hashes (the least uniform input a scheme can give) spread evenly.
    hashes = [i.to_bytes(8, "little") for i in range(30_000)]
    counts = {g.group_id: 0 for g in GROUPS}
    for gid, positions in m.positions_by_group(hashes).items():
        counts[gid] = len(positions)
    assert all(9_000 < c < 11_000 for c in counts.values()), counts


def test_positions_by_group_agrees_with_shard_of() -> None:
    m = even_map(GROUPS, shards_per_group=3)
    hashes = [os.urandom(16) for _ in range(500)]
    by_group = m.positions_by_group(hashes)
    assert sorted(i for p in by_group.values() for i in p) == list(range(500))
    for gid, positions in by_group.items():
        for i in positions:
            assert m.shard_of(hashes[i]).group_id == gid
            assert m.owns(gid, shard_key(hashes[i]))


def test_split_then_move() -> None:
    m = even_map(GROUPS[:2])
    s0 = m.shards[0]
    m2 = m.with_split(s0.shard_id, 7)
    assert m2.version == 2 and len(m2.shards) == 3
    lower, upper = m2.shards[0], m2.shards[1]
    assert (lower.lo, lower.hi, upper.lo, upper.hi) == (0, s0.hi // 2, s0.hi // 2, s0.hi)
    assert lower.group_id == upper.group_id == s0.group_id
    m3 = m2.with_move_started(7, "g1")
    assert m3.version == 3 and m3.shard_of_key(upper.lo).state == MOVING
    assert m3.owns(s0.group_id, upper.lo)  # the source owns it until the move is done
    with pytest.raises(ShardMapError):
        m3.with_split(7, 8)
    m4 = m3.with_move_done(7)
    assert (
        m4.version == 4 and m4.owns("g1", upper.lo) and m4.shard_of_key(upper.lo).state == SERVING
    )
    assert ShardMap.from_json(m4.to_json()) == m4


@pytest.mark.parametrize(
    "shards",
    [
        (Shard(0, 0, KEY_SPACE // 2, "g0"),),  # a gap at the top
        (Shard(0, 0, KEY_SPACE // 2, "g0"), Shard(1, KEY_SPACE // 3, KEY_SPACE, "g0")),  # overlap
        (Shard(0, 0, KEY_SPACE, "nope"),),  # unknown group
        (Shard(0, 0, KEY_SPACE, "g0", SERVING, "g1"),),  # serving with a target
    ],
)
def test_bad_maps_are_refused(shards: tuple[Shard, ...]) -> None:
    with pytest.raises(ShardMapError):
        ShardMap(1, GROUPS, shards)


def test_bad_changes_and_text_are_refused() -> None:
    m = even_map(GROUPS[:1])
    with pytest.raises(ShardMapError):
        m.with_split(0, 0)
    with pytest.raises(ShardMapError):
        m.with_split(0, 1, at=0)
    with pytest.raises(ShardMapError):
        m.with_move_started(0, "g0")
    with pytest.raises(ShardMapError):
        m.with_move_done(0)
    with pytest.raises(ShardMapError):
        ShardMap.from_json('{"version": 1}')
    with pytest.raises(ShardMapError):
        ShardMap.from_json("not json")
