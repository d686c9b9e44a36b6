"""A replica's view of the shard map (directory/shard_view.py): ownership,
refusals, versions, handovers; and the map in the state machine and its
snapshot (directory/table.py, snapshot.py)."""

from __future__ import annotations

import io
import os

import pytest

from kvdir.core.shard_map import KEY_SPACE, Group, Shard, ShardMap, even_map
from kvdir.directory import snapshot
from kvdir.directory.commands import Reject, Rejected, SetShardMap, ShardMapSet
from kvdir.directory.shard_view import (
    NoShardMap,
    Ownership,
    ShardView,
    WrongShard,
    handover_error,
)
from kvdir.directory.table import Table

GROUPS = (Group("g0", ("127.0.0.1:1",)), Group("g1", ("127.0.0.1:2",)))
HASHES = [os.urandom(16) for _ in range(2000)]


def owned_by(m: ShardMap, group_id: str) -> list[bytes]:
    return [h for h in HASHES if m.shard_of(h).group_id == group_id]


def test_unsharded_owns_everything_without_a_map() -> None:
    ShardView("g0", sharded=False).check(HASHES)


def test_no_map_yet_is_refused() -> None:
    with pytest.raises(NoShardMap, match="no shard map yet"):
        ShardView("g1", sharded=True).check(HASHES[:1])


@pytest.mark.parametrize("shards_per_group", [1, 3])
def test_ownership_agrees_with_the_map(shards_per_group: int) -> None:
    m = even_map(GROUPS, shards_per_group).with_split(0, 99)
    for gid in ("g0", "g1"):
        own = Ownership.of(m, gid)
        assert not own.all_keys
        mine = owned_by(m, gid)
        assert own.first_foreign(mine) == -1
        for i, h in enumerate(HASHES):
            assert (own.first_foreign([h]) < 0) == (m.shard_of(h).group_id == gid), i
            assert own.first_foreign([*mine[:3], h]) == (-1 if h in mine else 3)


def test_keys_at_the_edges_of_the_space() -> None:
    """The last shard reaches 2**64: a key of all ones is inside it."""
    edge = [Group("g0", ("a:1",)), Group("g1", ("b:1",))]
    m = ShardMap(
        1,
        tuple(edge),
        (
            Shard(0, 0, 1, "g1"),
            Shard(1, 1, KEY_SPACE - 1, "g0"),
            Shard(2, KEY_SPACE - 1, KEY_SPACE, "g1"),
        ),
    )
    g0, g1 = Ownership.of(m, "g0"), Ownership.of(m, "g1")
    assert len(g1.los) == 2
    for key in (0, 1, KEY_SPACE - 2, KEY_SPACE - 1):
        k = key.to_bytes(8, "big")
        assert g0._owns(k) == (m.shard_of_key(key).group_id == "g0"), key
        assert g1._owns(k) == (m.shard_of_key(key).group_id == "g1"), key


def test_adjacent_shards_merge_and_a_whole_space_owner_pays_nothing() -> None:
    m = even_map(GROUPS[:1], 4)
    own = Ownership.of(m, "g0")
    assert own.all_keys and len(own.los) == 1
    two = even_map(GROUPS, 1).with_split(0, 7)
    assert len(Ownership.of(two, "g0").los) == 1  # two halves of one range: merged


def test_wrong_shard_names_the_owner_and_the_version() -> None:
    m = even_map(GROUPS, 2)
    view = ShardView("g0", sharded=True)
    assert view.offer(m) and view.version == 1
    mine, theirs = owned_by(m, "g0"), owned_by(m, "g1")
    view.check(mine)
    with pytest.raises(WrongShard, match="owned by group 'g1' under shard map v1") as e:
        view.check(mine[:5] + theirs[:1])
    assert e.value.version == 1
    assert theirs[0].hex() in str(e.value)


def test_versions_only_go_up() -> None:
    m = even_map(GROUPS)
    view = ShardView("g1", sharded=True)
    m2 = m.with_split(0, 5)
    assert view.offer(m2)
    assert not view.offer(m)
    assert not view.offer(m2)
    assert view.version == 2


def test_handover_only_by_a_finished_move() -> None:
    m = even_map(GROUPS, 2)
    assert handover_error(None, m) is None
    assert handover_error(m, m.with_split(0, 9)) is None
    started = m.with_move_started(0, "g1")
    assert handover_error(m, started) is None
    assert handover_error(started, started.with_move_done(0)) is None
    assert handover_error(started, started.with_move_aborted(0)) is None
    # Giving shard 0's keys to g1 outright would hide g0's entries for them.
    swapped = ShardMap(2, m.groups, tuple(type(s)(s.shard_id, s.lo, s.hi, "g1") for s in m.shards))
    why = handover_error(m, swapped)
    assert why is not None and "from group 'g0' to 'g1' without a finished move" in why


def test_the_state_machine_compare_and_sets() -> None:
    t = Table()
    m = even_map(GROUPS)
    assert t.apply(SetShardMap(1, m)) == Rejected(
        Reject.STALE_SHARD_MAP, "shard map version 1 expected, 0 is committed"
    )
    res = t.apply(SetShardMap(0, m.with_split(0, 3)))  # version 2 where 1 is next
    assert isinstance(res, Rejected) and res.reason is Reject.BAD_SHARD_MAP
    assert t.apply(SetShardMap(0, m)) == ShardMapSet(m)
    assert t.shard_map == m
    res = t.apply(SetShardMap(0, m))  # the same proposal again: already done
    assert isinstance(res, Rejected) and res.reason is Reject.STALE_SHARD_MAP
    swapped = ShardMap(2, m.groups, tuple(type(s)(s.shard_id, s.lo, s.hi, "g1") for s in m.shards))
    res = t.apply(SetShardMap(1, swapped))
    assert isinstance(res, Rejected) and res.reason is Reject.BAD_SHARD_MAP
    assert t.shard_map == m


def test_the_map_survives_a_snapshot_and_counts_in_the_digest() -> None:
    t = Table()
    empty_digest = t.digest()
    m = even_map(GROUPS, 2)
    t.apply(SetShardMap(0, m))
    assert t.digest() != empty_digest
    buf = io.BytesIO()
    snapshot.write_to(buf, snapshot.capture(t), {}, [])
    buf.seek(0)
    loaded, _, _ = snapshot.load(buf)
    assert loaded.shard_map == m
    assert loaded.digest() == t.digest()


def test_a_format_2_snapshot_still_loads_without_a_map() -> None:
    t = Table()
    image = snapshot.capture(t)
    image.meta["format"] = 2
    del image.meta["shard_map"]
    buf = io.BytesIO()
    snapshot.write_to(buf, image, {}, [])
    buf.seek(0)
    loaded, _, _ = snapshot.load(buf)
    assert loaded.shard_map is None


def test_owns_all_is_what_lets_a_request_skip_the_check() -> None:
    assert ShardView("g0", sharded=False).owns_all
    view = ShardView("g0", sharded=True)
    assert not view.owns_all  # no map yet: the check must refuse
    view.offer(even_map(GROUPS[:1], 4))
    assert view.owns_all
    view.offer(even_map(GROUPS, 2).with_groups(GROUPS).with_split(0, 9))
    assert not view.owns_all
