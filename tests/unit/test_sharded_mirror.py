"""A sharded mirror fed by several groups' Watch services answers as one table of the whole log.

Each group is a real in-process replica with its own WatchService (the
consensus port's MemoryCluster, as tests/unit/test_mirror.py). The log is the
seeded simulation's; it is split as a sharded client splits it (Publish and
Remove by owner, node-wide commands to every group), and wrong-group
Publishes (records no lookup may ever return) are slipped into the groups to
check the ownership filter. Every group's mirror must equal its replica, and
every lookup must equal the whole log's table's, whatever order the streams
are drained in, across resumes and fresh snapshots.
"""

from __future__ import annotations

import random

import pytest

from kvdir.core.client import records
from kvdir.core.mirror import Mirror, NotServed
from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.core.sharded_mirror import ShardedMirror
from kvdir.directory import answer, codec
from kvdir.directory.commands import Command, Publish, RegisterNode, Remove
from kvdir.directory.limits import WatchLimits
from kvdir.directory.lookup import Chain
from kvdir.directory.table import Table
from kvdir.directory.watch_hub import CutOff, Watcher
from kvdir.v1 import directory_pb2 as pb
from tests.sim.test_replicas import Workload
from tests.unit.test_mirror import Clock, pb_ns
from tests.unit.watch_helpers import LocalReplica

LOG = 300


class Feed:
    """One group's stream drained by hand into its feed (as watch_helpers.Stream)."""

    def __init__(self, replica: LocalReplica, feed: Mirror) -> None:
        self.replica, self.feed = replica, feed
        self.watcher: Watcher
        self.watcher, chunks = replica.service.open(pb.WatchRequest(from_index=feed.resume_index()))
        for ev in chunks:
            feed.on_event(ev)

    def drain(self) -> CutOff | None:
        for _ in range(10_000):
            ev = self.replica.service.next_event(self.watcher, 0.0)
            if isinstance(ev, CutOff):
                return ev
            self.feed.on_event(ev)
            if ev.WhichOneof("event") == "heartbeat":
                return None
        raise AssertionError("the stream never went idle")

    def close(self) -> None:
        self.replica.service.hub.close(self.watcher)


def split(m: ShardMap, cmd: Command) -> dict[str, Command]:
    """What each group's log gets of `cmd` (the sharded client's routing)."""
    if isinstance(cmd, Publish):
        return {
            g: Publish(
                cmd.node_id,
                cmd.incarnation,
                cmd.namespace,
                cmd.tier,
                [cmd.hashes[i] for i in p],
                [cmd.addresses[i] for i in p],
                [cmd.lengths[i] for i in p],
                [cmd.rkeys[i] for i in p],
                [cmd.generations[i] for i in p],
            )
            for g, p in m.positions_by_group(cmd.hashes).items()
        }
    if isinstance(cmd, Remove) and cmd.hashes:
        n = len(cmd.hashes)
        return {
            g: Remove(
                cmd.node_id,
                cmd.incarnation,
                cmd.namespace,
                cmd.tier,
                [cmd.hashes[i] for i in p],
                [cmd.generations[i] for i in p] if len(cmd.generations) == n else [],
                [cmd.addresses[i] for i in p] if len(cmd.addresses) == n else [],
            )
            for g, p in m.positions_by_group(cmd.hashes).items()
        }
    return {g.group_id: cmd for g in m.groups}


def stray(m: ShardMap, into: str, cmd: Command) -> Command | None:
    """A Publish of `cmd`'s blocks that group `into` does not own (the filter's test)."""
    if not isinstance(cmd, Publish):
        return None
    p = [i for i, h in enumerate(cmd.hashes) if m.shard_of(h).group_id != into]
    if not p:
        return None
    return Publish(
        cmd.node_id,
        cmd.incarnation,
        cmd.namespace,
        cmd.tier,
        [cmd.hashes[i] for i in p],
        [0xDEAD for _ in p],
        [1 for _ in p],
        [1 for _ in p],
        [1 << 50 for _ in p],
    )


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_union_equals_the_whole_log(groups: int, seed: int) -> None:
    rng = random.Random(seed)
    log = Workload(seed).run(LOG)
    m = even_map([Group(f"g{i}", (f"127.0.0.1:{i + 1}",)) for i in range(groups)], 2)
    limits = WatchLimits(history_entries_max=24, buffer_entries_max=64)
    reps = {g.group_id: LocalReplica(limits) for g in m.groups}
    whole = Table()
    mirror = ShardedMirror(m, clock=Clock())
    feeds: dict[str, Feed] = {}
    strays = 0
    start = rng.randrange(LOG // 3)
    for i, blob in enumerate(log.entries):
        cmd = codec.decode(blob)
        whole.apply(cmd)
        for g, part in split(m, cmd).items():
            reps[g].write(part)
        if rng.random() < 0.15:
            into = rng.choice(sorted(reps))
            bad = stray(m, into, cmd)
            if bad is not None:
                reps[into].write(bad)
                strays += 1
        if i == start:
            feeds = {g: Feed(r, mirror.mirrors[g]) for g, r in reps.items()}
        if feeds and rng.random() < 0.2:
            g = rng.choice(sorted(feeds))
            if rng.random() < 0.2:  # the stream broke: resume (history or snapshot)
                feeds[g].close()
                feeds[g] = Feed(reps[g], mirror.mirrors[g])
            if feeds[g].drain() is not None:
                feeds[g].close()
                feeds[g] = Feed(reps[g], mirror.mirrors[g])
                assert feeds[g].drain() is None
    for g in sorted(feeds):
        if feeds[g].drain() is not None:
            feeds[g].close()
            feeds[g] = Feed(reps[g], mirror.mirrors[g])
            assert feeds[g].drain() is None
    for g, mg in mirror.mirrors.items():
        assert mg.applied_index == reps[g].index
        assert mg.table.digest() == reps[g].table.digest()
    for ns, hs in log.chains:
        want = pb.LookupResponse()
        answer.fill(want.matches, whole, whole.lookup(ns, hs, 8), False)
        assert mirror.prefix_lengths(ns, Chain.of(hs), 8) == [
            (x.node_id, x.prefix_blocks) for x in want.matches
        ]
        assert list(mirror.lookup(pb_ns(ns), hs, 8).matches) == list(want.matches)
    assert mirror.snapshots >= groups


def test_a_stale_group_cuts_chains_and_all_stale_is_not_served() -> None:
    log = Workload(3).run(LOG)
    m = even_map([Group("g0", ("a:1",)), Group("g1", ("b:1",))], 1)
    reps = {g.group_id: LocalReplica() for g in m.groups}
    whole = Table()
    for blob in log.entries:
        cmd = codec.decode(blob)
        whole.apply(cmd)
        for g, part in split(m, cmd).items():
            reps[g].write(part)
    clock = Clock()
    mirror = ShardedMirror(m, max_staleness_s=1.0, clock=clock)
    feeds = {g: Feed(r, mirror.mirrors[g]) for g, r in reps.items()}
    for f in feeds.values():
        f.drain()
    clock.t += 0.5
    feeds["g0"].drain()  # g0 heard from; g1 silent for 1.5 s from here
    clock.t += 1.0
    assert mirror.mirrors["g0"].lag().fresh and not mirror.mirrors["g1"].lag().fresh
    for ns, hs in log.chains:
        owners = m.positions_by_group(hs)
        if set(owners) == {"g1"}:  # only a stale group owns it: ask the replicas
            with pytest.raises(NotServed):
                mirror.lookup(pb_ns(ns), hs)
            continue
        first = owners.get("g1", [len(hs)])[0]
        want = [(x.node.node_id, x.prefix_blocks) for x in whole.lookup(ns, hs[:first], 8)]
        assert mirror.prefix_lengths(ns, Chain.of(hs), 8) == (want if first else [])
        got = [(x.node_id, x.prefix_blocks) for x in mirror.lookup(pb_ns(ns), hs).matches]
        assert got == (want if first else [])
    clock.t += 1.0
    with pytest.raises(NotServed):
        mirror.lookup(pb_ns(log.chains[0][0]), log.chains[0][1])


def test_a_newer_map_moves_reads_to_the_new_owner() -> None:
    """A moved shard is read from its new owner's table once the mirror has the map
    naming it (the old owner's copy, not yet dropped, is no longer read)."""
    m1 = even_map([Group("g0", ("a:1",)), Group("g1", ("b:1",))], 1)
    moved = m1.with_move_started(0, "g1").with_move_done(0)
    clock = Clock()
    mirror = ShardedMirror(m1, clock=clock)
    ns = "m\x1f\x1f16\x1f\x1f0/0"
    hs = [h for h in (bytes([i]) * 8 for i in range(64)) if m1.shard_of(h).group_id == "g0"][:3]
    for g, addr in (("g0", 1), ("g1", 2)):  # both tables hold the blocks: a move mid-way
        t = mirror.mirrors[g].table
        t.apply(RegisterNode("n", "h", "e", ("tcp",), 1, 60_000, 0))
        t.apply(Publish("n", 1, ns, 1, hs, [addr] * 3, [1] * 3, [1] * 3, [1] * 3))
        mirror.mirrors[g].ready, mirror.mirrors[g].cluster_id = True, ""
    for mg in mirror.mirrors.values():
        mg.on_event(pb.WatchEvent(heartbeat=pb.WatchHeartbeat(), applied_index=0))
    first = mirror.lookup(pb_ns(ns), hs).matches[0]
    assert records(first).addresses == [1, 1, 1]  # g0 owns them under m1
    assert mirror.set_map(moved) and mirror.map.version == moved.version
    assert records(mirror.lookup(pb_ns(ns), hs).matches[0]).addresses == [2, 2, 2]
    assert mirror.set_map(m1)  # an older map changes nothing
    assert mirror.map is moved
    grown = ShardMap(moved.version + 1, (*moved.groups, Group("g2", ("c:1",))), moved.shards)
    assert not mirror.set_map(grown)  # new streams needed: refused, the mirror restarts
