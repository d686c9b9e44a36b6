"""Pool epochs and slot owners (issue 28 item 4), against real pool files.

A pool of another shape is a new file under a new epoch, renamed over the old
path; the old file is marked retired and never truncated, so a mapping of it
stays readable (no SIGBUS) and never reaches the new file. Allocated slots
record their owner process; the slots of an owner that is gone come back
with their generation bumped. Real child processes stand for engines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdir.agent.owners import NO_OWNER, Owner, alive, owner_of, start_ticks
from kvdir.agent.pool import ALLOCATED, FREE, STORED, Geometry, KvPool
from kvdir.agent.pool_file import read_superblock
from kvdir.transfer.memory import SharedMemory

SLOT_BYTES = 4096
SLOTS = 16
NS_KEY = "unit-model/16"


def _engine_view(path: str) -> KvPool:
    """What the engine library maps: the file as it is now, read-write."""
    mem = SharedMemory.open_readwrite(path, owner=False)
    sb = read_superblock(mem.mm)
    assert sb is not None
    return KvPool(mem, Geometry.of(sb.slot_bytes, sb.slots), "")


def test_reopening_the_same_shape_keeps_the_file_and_its_epoch(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    epoch, inode = first.epoch, os.stat(path).st_ino
    first.close()
    again = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        assert (again.epoch, os.stat(path).st_ino, again.retired) == (epoch, inode, False)
        assert epoch != 0
    finally:
        again.close()


@pytest.mark.parametrize(("slot_bytes", "slots"), [(SLOT_BYTES, SLOTS), (SLOT_BYTES * 4, 2)])
def test_a_new_epoch_is_a_new_file_and_the_old_mapping_stays_whole(
    tmp_path: Path, slot_bytes: int, slots: int
) -> None:
    """Same shape forced fresh (a GPU tier) or a smaller file: the engine's old
    mapping reads its old bytes to the last slot, sees `retired`, and the new
    file never sees writes made through it."""
    path = str(tmp_path / "pool")
    agent = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    engine = _engine_view(path)
    old_epoch = engine.epoch
    (slot, gen), *_ = agent.allocate(SLOTS)
    last = SLOTS - 1
    engine.slot_view(last)[:4] = b"old!"
    agent.close()

    fresh = KvPool.open(path, NS_KEY, slot_bytes, slots, fresh=True)
    try:
        assert fresh.epoch not in (0, old_epoch)
        assert not fresh.retired and engine.retired
        assert engine.epoch == old_epoch  # the old file keeps its own epoch
        # The whole old mapping is still there (a truncated file would SIGBUS here).
        assert bytes(engine.slot_view(last)[:4]) == b"old!"
        engine.slot_view(last)[:4] = b"late"
        assert engine.header(slot).generation == gen
        # ... and nothing written through it reaches the new file.
        new_last = fresh.geometry.slots - 1
        assert bytes(fresh.slot_view(new_last)[:4]) == b"\0" * 4
        assert all(fresh.header(s).state == FREE for s in range(fresh.geometry.slots))
        assert os.path.getsize(path) >= fresh.geometry.size
        assert sorted(os.listdir(tmp_path)) == ["pool"]  # no temporary file left
    finally:
        fresh.close()
        engine.close()


def test_an_engine_view_of_the_new_file_sees_the_new_epoch(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS).close()
    new = KvPool.open(path, NS_KEY, SLOT_BYTES * 2, SLOTS)
    engine = _engine_view(path)
    try:
        assert engine.epoch == new.epoch and not engine.retired
        assert engine.geometry == new.geometry
    finally:
        engine.close()
        new.close()


def test_a_half_made_pool_file_of_a_dead_agent_is_removed(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    mine = tmp_path / f"pool.new-{os.getppid()}"  # a live process's: left alone
    dead = tmp_path / f"pool.new-{child.pid}"
    for f in (mine, dead):
        f.write_bytes(b"half")
    KvPool.open(str(tmp_path / "pool"), NS_KEY, SLOT_BYTES, SLOTS).close()
    assert sorted(os.listdir(tmp_path)) == sorted(["pool", mine.name])
    assert mine.read_bytes() == b"half"


def test_a_retired_file_is_never_attached_again(tmp_path: Path) -> None:
    """An agent that finds a retired file (it crashed mid-replace) starts a new epoch."""
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    epoch = first.epoch
    keep = str(tmp_path / "kept")
    os.link(path, keep)
    first.close()
    KvPool.open(path, NS_KEY, SLOT_BYTES * 2, SLOTS).close()  # retires the old inode
    os.replace(keep, path)  # the retired file back at the path
    again = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        assert again.epoch != epoch and not again.retired
    finally:
        again.close()


# ------------------------------------------------------------------ owners


def test_owners_name_a_process_and_its_start() -> None:
    me = owner_of(os.getpid())
    assert me.pid == os.getpid() and me.start_ticks == start_ticks(os.getpid()) > 0
    assert alive(me)
    assert not alive(Owner(me.pid, me.start_ticks + 1))  # a reused pid is someone else
    assert owner_of(0) == NO_OWNER and alive(NO_OWNER)  # unknown: never reclaimed


def test_a_dead_process_is_not_alive_and_a_zombie_neither() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = owner_of(child.pid)
    # Exited but not reaped yet (a zombie) or gone: either way it writes nothing.
    child.wait(timeout=30)
    assert owner.pid == child.pid
    assert not alive(owner)


def test_allocations_record_their_owner_and_keep_it_across_evictions(tmp_path: Path) -> None:
    pool = KvPool.open(str(tmp_path / "pool"), NS_KEY, SLOT_BYTES, SLOTS)
    try:
        a, b = Owner(11, 111), Owner(22, 222)
        got_a = [s for s, _ in pool.allocate(3, a)]
        got_b = [s for s, _ in pool.allocate(2, b)]
        assert pool.allocated_by_owner() == {a: sorted(got_a), b: sorted(got_b)}
        # Stored slots are nobody's reservation; an evicted one is its owner's again.
        assert pool.mark_stored(got_a[0], b"h", pool.header(got_a[0]).generation)
        assert pool.allocated_by_owner()[a] == sorted(got_a[1:])
        pool.evict(got_a[0])
        assert pool.owner(got_a[0]) == a
        assert sorted(pool.allocated_by_owner()[a]) == sorted(got_a)
        pool.set_owner(got_b[:1], a)
        assert pool.owner(got_b[0]) == a
        pool.free(got_a)
        assert all(pool.owner(s) == NO_OWNER for s in got_a)
        assert a not in pool.allocated_by_owner() or pool.allocated_by_owner()[a] == [got_b[0]]
    finally:
        pool.close()


def test_reclaim_frees_only_what_the_owner_still_holds_and_bumps_generations(
    tmp_path: Path,
) -> None:
    pool = KvPool.open(str(tmp_path / "pool"), NS_KEY, SLOT_BYTES, SLOTS)
    try:
        dead, other = Owner(11, 111), Owner(22, 222)
        held = pool.allocate(4, dead)
        slots = [s for s, _ in held]
        stored = slots[0]
        assert pool.mark_stored(stored, b"h", held[0][1])
        pool.set_owner([slots[1]], other)  # changed hands since the scan
        free_before = pool.free_slots
        got = pool.reclaim(slots, dead)
        assert sorted(got) == sorted(slots[2:])
        assert pool.free_slots == free_before + 2
        for s, gen in held[2:]:
            hdr = pool.header(s)
            assert (hdr.state, pool.owner(s)) == (FREE, NO_OWNER)
            assert hdr.generation > gen  # a reader of what it held fails validation
        assert pool.header(stored).state == STORED
        assert pool.header(slots[1]).state == ALLOCATED and pool.owner(slots[1]) == other
        # Reclaimed slots are handed out again, under newer generations still.
        again = dict(pool.allocate(pool.free_slots))
        assert all(again[s] > gen for s, gen in held[2:])
    finally:
        pool.close()


def test_owners_survive_reopening(tmp_path: Path) -> None:
    """A restarted agent still knows whose the reserved slots are (they are in the headers)."""
    path = str(tmp_path / "pool")
    pool = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    owner = Owner(33, 333)
    slots = sorted(s for s, _ in pool.allocate(5, owner))
    pool.close()
    again = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        assert again.allocated_by_owner() == {owner: slots}
        assert again.free_slots == SLOTS - 5
    finally:
        again.close()


# ------------------------------------------------------- the agent's reaper


def test_the_reaper_frees_only_dead_owners_slots_and_waits_out_a_fetch(tmp_path: Path) -> None:
    """PoolState.reclaim_dead with liveness injected: a slot a Fetch writes into
    stays until the fetch ends; a live owner's slots are never touched."""
    from kvdir.agent.service import PoolState
    from kvdir.core.client import namespace
    from kvdir.transfer.base import Region

    pool = KvPool.open(str(tmp_path / "pool"), NS_KEY, SLOT_BYTES, SLOTS)
    try:
        state = PoolState(namespace("unit-model", 16), pool, Region(0, 0, 0), 0)
        dead, live = Owner(11, 111), Owner(22, 222)
        dead_slots = sorted(s for s, _ in pool.allocate(4, dead))
        live_slots = sorted(s for s, _ in pool.allocate(2, live))
        state.fetching.update(dead_slots[:1])
        assert state.reclaim_dead(lambda o: o == live) == 3
        assert pool.allocated_by_owner() == {dead: dead_slots[:1], live: live_slots}
        del state.fetching[dead_slots[0]]
        assert state.reclaim_dead(lambda o: o == live) == 1
        assert pool.allocated_by_owner() == {live: live_slots}
        assert state.reclaim_dead(lambda o: o == live) == 0
    finally:
        pool.close()


def test_the_engine_library_never_maps_a_file_other_than_the_one_described(
    tmp_path: Path,
) -> None:
    """The file replaced between the agent's Attach answer and the mapping: refused."""
    from kvdir.agent.engine.client import PoolChanged, _AttachedPool
    from kvdir.v1 import agent_pb2 as apb

    path = str(tmp_path / "pool")
    agent = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        good = apb.PoolInfo(path=path, slot_bytes=SLOT_BYTES, slots=SLOTS, epoch=agent.epoch)
        mapped = _AttachedPool(good)
        assert mapped.current() and mapped.pool.epoch == agent.epoch
        mapped.pool.close()
        for info in (
            apb.PoolInfo(path=path, slot_bytes=SLOT_BYTES, slots=SLOTS, epoch=agent.epoch ^ 1),
            apb.PoolInfo(path=path, slot_bytes=SLOT_BYTES, slots=SLOTS * 2, epoch=agent.epoch),
        ):
            with pytest.raises(PoolChanged):
                _AttachedPool(info)
    finally:
        agent.close()
