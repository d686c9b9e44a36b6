"""A mirror fed by a replica's Watch service equals the replica at the same index.

The logs are the seeded simulation's (tests/sim/test_replicas.py): agents
registering, publishing, removing, restarting, expiring, with duplicates.
"""

from __future__ import annotations

import io
import random
from typing import Any

import pytest

from kvdir.core.mirror import Mirror, MirrorError, NotServed
from kvdir.directory import codec, snapshot
from kvdir.directory.limits import WatchLimits
from kvdir.directory.lookup import Chain
from kvdir.directory.table import Records, Table
from kvdir.directory.watch import namespace_of
from kvdir.directory.watch_hub import Refused
from kvdir.v1 import directory_pb2 as pb
from tests.sim.test_replicas import NAMESPACES, Workload, digest
from tests.unit.watch_helpers import LocalReplica, connect

SEEDS = range(5)
LOG = 300


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pb_ns(key: str) -> pb.Namespace:
    model, dtype, bt, layout, tp = key.split("\x1f")
    rank, size = tp.split("/")
    return pb.Namespace(
        model=model,
        dtype=dtype,
        block_tokens=int(bt),
        layout=layout,
        tp_rank=int(rank),
        tp_size=int(size),
    )


def same(mirror: Mirror, replica: LocalReplica, chains: list[tuple[str, list[bytes]]]) -> None:
    assert mirror.applied_index == replica.index
    assert mirror.table.digest() == replica.table.digest()
    assert digest(mirror.table, chains) == digest(replica.table, chains)
    for ns, hs in chains:  # the routing form answers as the full lookup does
        full = [(m.node.node_id, m.prefix_blocks) for m in replica.table.lookup(ns, hs, 8)]
        assert mirror.table.prefix_lengths(ns, Chain.of(hs), 8) == full


@pytest.mark.parametrize("seed", SEEDS)
def test_mirror_follows_resumes_and_resyncs(seed: int) -> None:
    """Snapshot start mid-log, live commands, resume from history, resume past it."""
    log = Workload(seed).run(LOG)
    rng = random.Random(seed)
    limits = WatchLimits(history_entries_max=32, buffer_entries_max=64)
    replica = LocalReplica(limits)
    mirror = Mirror(clock=Clock())
    start = rng.randrange(LOG // 3)
    for blob in log.entries[:start]:
        replica.apply(blob, skip=rng.choice((0, 0, 0, 1)))
    stream = connect(replica, mirror)
    assert mirror.snapshots == 1
    same(mirror, replica, log.chains)
    i = start
    while i < LOG:
        step = rng.choice((1, 5, 20, 50))
        for blob in log.entries[i : i + step]:
            replica.apply(blob, skip=rng.choice((0, 0, 1)))
        i += step
        roll = rng.random()
        if roll < 0.2:  # the stream broke: resume from our index (history or snapshot)
            stream.close()
            stream = connect(replica, mirror)
        cut = stream.drain()
        if cut is not None:
            assert cut.reason == "watcher-too-slow"
            stream.close()
            stream = connect(replica, mirror)
            assert stream.drain() is None
        same(mirror, replica, log.chains)
    assert mirror.snapshots >= 1


def test_resume_within_history_needs_no_snapshot() -> None:
    log = Workload(1).run(100)
    replica = LocalReplica()
    mirror = Mirror(clock=Clock())
    for blob in log.entries[:50]:
        replica.apply(blob)
    s = connect(replica, mirror)
    s.drain()
    s.close()
    for blob in log.entries[50:]:
        replica.apply(blob)
    s = connect(replica, mirror)
    s.drain()
    assert mirror.snapshots == 1  # only the first
    same(mirror, replica, log.chains)


def test_slow_watcher_is_cut_off_and_the_hub_keeps_going() -> None:
    log = Workload(2).run(200)
    replica = LocalReplica(WatchLimits(history_entries_max=8, buffer_entries_max=16))
    mirror = Mirror(clock=Clock())
    s = connect(replica, mirror)
    for blob in log.entries:
        replica.apply(blob)
    cut = s.drain()
    assert cut is not None and cut.reason == "watcher-too-slow"
    assert f"resume from index {cut.resume_from}" in cut.message
    assert replica.service.hub.cut_offs == 1
    s.close()
    s = connect(replica, mirror)  # history no longer covers us: a fresh snapshot
    assert s.drain() is None
    assert mirror.snapshots == 2
    same(mirror, replica, log.chains)


def test_snapshot_install_cuts_everyone_off() -> None:
    log = Workload(3).run(50)
    replica = LocalReplica()
    mirror = Mirror(clock=Clock())
    s = connect(replica, mirror)
    for blob in log.entries:
        replica.apply(blob)
    replica.hold()
    for _ in range(10):
        replica.noop()
    replica.consensus.install_snapshot()  # the table jumps past what the hub saw
    assert replica.index == replica.commit
    cut = s.drain()
    assert cut is not None and cut.reason == "snapshot-installed"


def test_refusals() -> None:
    log = Workload(4).run(20)
    replica = LocalReplica(WatchLimits(watchers_max=1))
    for blob in log.entries:
        replica.apply(blob)
    with pytest.raises(Refused) as e:
        replica.service.open(pb.WatchRequest(from_index=replica.index + 5))
    assert e.value.code == "OUT_OF_RANGE" and e.value.reason == "bad-from-index"
    w, _ = replica.service.open(pb.WatchRequest())
    with pytest.raises(Refused) as e:
        replica.service.open(pb.WatchRequest())
    assert e.value.code == "RESOURCE_EXHAUSTED"
    replica.service.hub.close(w)
    replica.service.open(pb.WatchRequest(from_index=replica.index))  # room again


def test_reads_never_go_backwards() -> None:
    """A snapshot older than the mirror, and commands it has, change nothing."""
    log = Workload(5).run(120)
    behind, ahead = LocalReplica(), LocalReplica()
    for blob in log.entries[:60]:
        behind.apply(blob)
    for blob in log.entries:
        ahead.apply(blob)
    mirror = Mirror(clock=Clock())
    connect(ahead, mirror).drain()
    at = mirror.applied_index
    d = mirror.table.digest()
    with pytest.raises(Refused, match="past this replica's commit index"):
        connect(behind, mirror)  # `behind` has not even heard of our index
    behind.hold()
    for blob in log.entries[60:]:  # now it has (committed, not applied yet)
        behind.apply(blob)
    assert behind.index == 60 < at <= behind.commit
    s = connect(behind, mirror)
    mirror.resume_index()
    for ev in behind.service.open(pb.WatchRequest())[1]:  # an older snapshot
        mirror.on_event(ev)
    assert mirror.applied_index == at and mirror.table.digest() == d
    behind.release()  # `behind` catches up: it resends what we have
    s.drain()
    assert mirror.applied_index == at and mirror.table.digest() == d


def test_staleness_and_lag() -> None:
    log = Workload(6).run(40)
    clock = Clock()
    replica = LocalReplica()
    mirror = Mirror(max_staleness_s=0.5, clock=clock)
    space = pb_ns(NAMESPACES[0])
    with pytest.raises(NotServed) as e:
        mirror.lookup(space, [b"x" * 8])
    assert e.value.reason == "stale"
    s = connect(replica, mirror)
    s.drain()
    assert mirror.fresh() and mirror.lag().entries == 0 and mirror.lag().ms == 0
    for blob in log.entries:
        replica.apply(blob)
    replica.hold()
    for _ in range(7):  # committed on the leader, not yet applied here
        replica.noop()
    s.drain()
    clock.t += 0.2
    lag = mirror.lag()
    assert lag.entries == 7 and lag.ms == pytest.approx(200)
    assert lag.fresh
    clock.t += 0.4
    assert not mirror.fresh()
    with pytest.raises(NotServed):
        mirror.lookup(space, [b"x" * 8])
    replica.release()  # applied (no commands among them)
    s.drain()
    assert mirror.fresh()
    clock.t += 0.6  # silence
    assert not mirror.fresh() and mirror.lag().silent_ms == pytest.approx(600)


def test_namespace_filter() -> None:
    log = Workload(7).run(200)
    replica = LocalReplica()
    keep = pb_ns(NAMESPACES[0])
    mirror = Mirror(clock=Clock(), namespaces=[keep])
    s = connect(replica, mirror, [keep])
    for blob in log.entries:
        replica.apply(blob)
    s.drain()
    for ns, chain in log.chains:
        if ns != NAMESPACES[0]:
            continue
        got = [(m.node.node_id, m.prefix_blocks) for m in mirror.table.lookup(ns, chain, 64)]
        want = [(m.node.node_id, m.prefix_blocks) for m in replica.table.lookup(ns, chain, 64)]
        assert got == want
    with pytest.raises(NotServed) as e:
        mirror.lookup(pb_ns(NAMESPACES[1]), [b"y" * 32])
    assert e.value.reason == "namespace-not-mirrored"


def test_a_filtered_mirror_starts_from_its_namespaces_entries_only() -> None:
    """Its snapshot, and the table it keeps after, are the filtered log's table."""
    log = Workload(8).run(300)
    replica = LocalReplica()
    keep = pb_ns(NAMESPACES[0])
    for blob in log.entries[:200]:
        replica.apply(blob)
    assert set(replica.table.ns_names) == set(NAMESPACES)
    mirror = Mirror(clock=Clock(), namespaces=[keep])
    s = connect(replica, mirror, [keep])
    assert mirror.snapshots == 1
    assert mirror.table.digest() == filtered_table(log.entries[:200], NAMESPACES[0]).digest()
    assert mirror.table.ns_names == [NAMESPACES[0]]
    for blob in log.entries[200:]:
        replica.apply(blob)
    s.drain()
    assert mirror.applied_index == replica.index
    assert mirror.table.digest() == filtered_table(log.entries, NAMESPACES[0]).digest()
    assert replica.table.blocks[replica.table.ns_ids[NAMESPACES[1]]]
    assert NAMESPACES[1] not in mirror.table.ns_ids
    for ns, hs in log.chains:
        if ns == NAMESPACES[0]:
            assert answers(mirror.table, ns, hs) == answers(replica.table, ns, hs)


def test_an_unfiltered_watcher_gets_the_whole_snapshot_unchanged() -> None:
    replica = LocalReplica()
    for blob in Workload(9).run(100).entries:
        replica.apply(blob)
    want = io.BytesIO()
    snapshot.write_to(want, snapshot.capture(replica.table), {}, [])
    _, chunks = replica.service.open(pb.WatchRequest())
    assert b"".join(ev.snapshot.data for ev in chunks) == want.getvalue()


def answers(t: Table, ns: str, hs: list[bytes]) -> list[tuple[str, int, Records]]:
    return [(m.node.node_id, m.prefix_blocks, t.records(m.slots)) for m in t.lookup(ns, hs, 64)]


def filtered_table(entries: list[bytes], namespace: str) -> Table:
    """The table of the commands a stream filtered to `namespace` carries."""
    t = Table()
    for blob in entries:
        cmd = codec.decode(blob)
        if namespace_of(cmd) in (None, namespace):
            t.apply(cmd)
    return t


def test_newer_command_format_stops_the_mirror() -> None:
    mirror = Mirror(clock=Clock())
    with pytest.raises(MirrorError, match="command format"):
        mirror.on_event(pb.WatchEvent(command_version=codec.VERSION + 1))


def test_a_reader_never_sees_an_applied_index_past_the_commit_index() -> None:
    """Issue 29 hole 6: the mirror heard an event's commit index only after applying its
    entries, so a read in between saw applied_index > commit_index (the chaos run's 5
    mirror reads "ahead"; every entry was committed, the mirror's count of it lagged)."""
    log = Workload(7).run(60)
    replica = LocalReplica()
    mirror = Mirror(clock=Clock())
    s = connect(replica, mirror)
    s.drain()
    seen: list[tuple[int, int]] = []
    table_apply = mirror.table.apply

    def apply(cmd: Any) -> Any:  # what a reader sees between two applies of one event
        seen.append((mirror.applied_index, mirror.commit_index))
        return table_apply(cmd)

    mirror.table.apply = apply  # type: ignore[method-assign]
    for blob in log.entries:
        replica.apply(blob)
    s.drain()
    assert len(seen) > 1
    assert all(applied <= commit for applied, commit in seen), seen[:5]
