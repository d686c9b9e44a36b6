"""Watch and mirrors against real replicas: equal tables, resync, clear refusals.

Mirrors follow real `kvdir directory serve` processes through leader kills,
replica restarts, snapshot installs (compaction every few hundred entries)
and a membership change; at every checkpoint each mirror's table digest
equals a replica's at the same applied index, and no mirror's applied index
ever went backwards.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvdir.core import wire
from kvdir.core.client import DirectoryClient, lookup_request
from kvdir.core.mirror import Mirror, MirroredDirectory
from kvdir.core.mirror_sync import MirrorSync
from kvdir.directory.table import Table
from kvdir.local import LocalCluster, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    chain,
    live,
    ns,
    publish,
    raw_stub,
    register,
    rpc_error,
    status,
    trailers,
    wait_converged,
)
from tests.integration.load import kvdir_ok

pytestmark = pytest.mark.integration

SPACE = ns("watch/model")
OTHER = ns("watch/other")
SNAPSHOT_OFTEN = ["--tune", "compaction_min_entries=300", "--tune", "compaction_min_time_s=1"]
NODES = ("watch-a", "watch-b")


class Writes:
    """Seeded random writes: publishes, guarded removes, clears, re-registrations."""

    def __init__(self, c: DirectoryClient, seed: int) -> None:
        self.c = c
        self.rng = random.Random(seed)
        self.inc = dict.fromkeys(NODES, 1)
        self.chains: list[list[bytes]] = []
        for n in NODES:
            register(self.c, n, self.inc[n])

    def run(self, n: int) -> None:
        for _ in range(n):
            self.one()

    def one(self) -> None:
        rng, node = self.rng, self.rng.choice(NODES)
        roll = rng.random()
        space = SPACE if rng.random() < 0.8 else OTHER
        if roll < 0.7 or not self.chains:
            hs = chain(rng.randint(1, 64), salt=rng.randrange(1 << 20))
            if self.chains and rng.random() < 0.4:  # share a prefix with an earlier chain
                hs = rng.choice(self.chains)[: rng.randint(1, 8)] + hs
                hs = list(dict.fromkeys(hs))
            self.chains.append(hs)
            publish(self.c, node, self.inc[node], space, hs, generation=rng.randint(1, 5))
        elif roll < 0.9:
            hs = rng.choice(self.chains)
            cut = hs[rng.randrange(len(hs)) :]
            self.c.remove(node, self.inc[node], space, pb.TIER_GPU, cut)
        elif roll < 0.95:
            self.c.clear_node(node, self.inc[node], space if rng.random() < 0.5 else None)
        else:
            self.inc[node] += 1  # an agent restart: drops everything it published
            register(self.c, node, self.inc[node])


class Monotonic:
    """Samples mirrors' applied indexes in the background; fails on any step back."""

    def __init__(self, mirrors: list[Mirror]) -> None:
        self.mirrors = mirrors
        self.stop = threading.Event()
        self.backwards: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last: dict[int, int] = {}
        while not self.stop.wait(0.005):
            for i, m in enumerate(list(self.mirrors)):
                at = m.applied_index
                if at < last.get(i, 0):
                    self.backwards.append(f"mirror {i}: {last[i]} -> {at}")
                last[i] = at


def checkpoint(cluster: LocalCluster, mirrors: list[Mirror], timeout_s: float = 30.0) -> None:
    """Every mirror at the replicas' (converged) index, with the same table digest."""
    st = wait_converged(cluster, timeout_s)
    index = next(iter(st.values())).applied_index
    for i, m in enumerate(mirrors):
        wait_for(
            lambda m=m: m.applied_index >= index,  # type: ignore[misc]
            timeout_s,
            f"mirror {i} to reach index {index} (at {m.applied_index}: {m.error})",
            0.02,
        )
    r = live(cluster)[0]
    with DirectoryClient([r.grpc_address], timeout_s=10) as c:
        resp = c.call("ClusterStatus", pb.ClusterStatusRequest(with_digest=True))
    assert resp.applied_index == index, "a write slipped in during the checkpoint"
    for i, m in enumerate(mirrors):
        at, digest = m.digest()
        assert at == index, f"mirror {i} at {at}, replicas at {index}"
        assert digest == resp.state_digest, f"mirror {i} differs from {r.replica_id} at {index}"


@pytest.fixture
def chaos_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(str(tmp_path), size=3, extra_args=SNAPSHOT_OFTEN)
    try:
        c.start(30)
        yield c
    finally:
        c.stop()


def follow(addresses: list[str]) -> tuple[Mirror, MirrorSync]:
    m = Mirror(max_staleness_s=2.0)
    return m, MirrorSync(m, addresses).start()


@pytest.mark.timeout(300)
def test_mirrors_equal_replicas_through_kills_restarts_snapshots_and_membership(
    chaos_cluster: LocalCluster,
) -> None:
    cluster = chaos_cluster
    spare = cluster.new_replica()
    cluster.size -= 1  # not a member until added
    r2 = cluster.replicas[1]
    syncs: list[MirrorSync] = []
    mirrors: list[Mirror] = []
    for addrs in ([r.grpc_address for r in cluster.replicas], [r2.grpc_address]):
        m, s = follow(addrs)
        mirrors.append(m)
        syncs.append(s)
    mono = Monotonic(mirrors)
    mono.thread.start()
    try:
        with cluster.client(timeout_s=20) as c:
            w = Writes(c, seed=17)
            w.run(150)
            checkpoint(cluster, mirrors)

            leader = cluster.wait_leader(10)
            cluster.kill(leader)
            w.run(150)
            cluster.launch(leader)
            checkpoint(cluster, mirrors)

            # A follower misses enough to be sent a snapshot when it comes back.
            leader = cluster.wait_leader(10)
            follower = r2 if r2 is not leader else next(r for r in live(cluster) if r is not leader)
            cluster.kill(follower)
            w.run(700)
            cluster.launch(follower)
            checkpoint(cluster, mirrors, 60)
            with open(follower.log_path) as f:
                assert "snapshot loaded" in f.read(), "the restarted follower loaded no snapshot"

            # A new member; a mirror that follows only it.
            spare.member = True
            cluster.size += 1
            spare.extra_args = ["--join"]
            joined = ",".join(r.grpc_address for r in cluster.replicas[:3])
            kvdir_ok(
                "ctl", "add-replica", spare.raft_address, "--addr", joined,
                "--id", spare.replica_id, "--grpc", spare.grpc_address,
            )  # fmt: skip
            cluster.launch(spare)
            m, s = follow([spare.grpc_address])
            mirrors.append(m)
            syncs.append(s)
            w.run(150)
            checkpoint(cluster, mirrors, 60)
            assert mirrors[1].snapshots >= 1
            same_answers(c, mirrors[0], w.chains[-40:], live(cluster)[0])
    finally:
        mono.stop.set()
        for s in syncs:
            s.stop()
    assert mono.backwards == []


def same_answers(c: DirectoryClient, m: Mirror, chains: list[list[bytes]], r: Replica) -> None:
    """The mirror's Lookup and LookupBatch answers are the RPC's, byte for byte (but ReadInfo)."""
    reqs = [lookup_request(SPACE, hs, max_nodes=8) for hs in chains]
    for req in reqs:
        got = m.lookup_message(req)
        want: pb.LookupResponse = c.call("Lookup", req, address=r.grpc_address)
        got.ClearField("read")
        want.ClearField("read")
        assert got == want
    got_b = m.lookup_batch(reqs)
    want_b = c.lookup_batch(reqs, address=r.grpc_address)
    got_b.ClearField("read")
    want_b.ClearField("read")
    assert got_b == want_b


@pytest.mark.timeout(180)
def test_a_filtered_mirror_holds_only_its_namespace(tmp_path: Path) -> None:
    """Its snapshot carries its namespace's entries (and every node), its answers are
    the RPC's, before and after commands that drop a node's entries; an unfiltered
    mirror next to it, equal to the replica by digest, is the count to compare with."""
    cluster = LocalCluster(str(tmp_path), size=1)
    try:
        cluster.start(30)
        r = cluster.replicas[0]
        with cluster.client(timeout_s=30) as c, raw_stub(r.grpc_address) as stub:
            w = Writes(c, seed=23)
            w.run(200)
            for i, n in enumerate(NODES):
                publish(c, n, w.inc[n], OTHER, chain(32, salt=900 + i))
            whole = first_event(stub, pb.WatchRequest()).snapshot.total_bytes
            part = first_event(stub, pb.WatchRequest(namespaces=[SPACE])).snapshot.total_bytes
            assert part < whole
            full, mine = Mirror(max_staleness_s=5.0), Mirror(5.0, namespaces=[SPACE])
            with (
                MirrorSync(full, [r.grpc_address]),
                MirrorSync(mine, [r.grpc_address]),
            ):
                only_its_namespace(c, r, full, mine, w.chains[-40:])
                assert mine.snapshots == 1
                w.run(150)  # clears, removes, restarts (a higher incarnation) among them
                for n in NODES:
                    w.inc[n] += 1
                    register(c, n, w.inc[n])
                    publish(c, n, w.inc[n], SPACE, chain(8, salt=950))
                    publish(c, n, w.inc[n], OTHER, chain(8, salt=960))
                only_its_namespace(c, r, full, mine, [*w.chains[-60:], chain(8, salt=950)])
    finally:
        cluster.stop()


def only_its_namespace(
    c: DirectoryClient, r: Replica, full: Mirror, mine: Mirror, chains: list[list[bytes]]
) -> None:
    target = status(r).applied_index
    for m in (full, mine):
        wait_for(
            lambda m=m: m.applied_index >= target,  # type: ignore[misc]
            20,
            f"the mirrors to reach {target} (at {m.applied_index}: {m.error})",
            0.02,
        )
    d = c.call("ClusterStatus", pb.ClusterStatusRequest(with_digest=True))
    assert full.digest() == (d.applied_index, d.state_digest)
    space, other = wire.namespace_key(SPACE), wire.namespace_key(OTHER)
    with full.lock, mine.lock:
        want = entries_in(full.table, space)
        assert entries_in(full.table, other) > 0 and want > 0
        assert mine.table.entries == entries_in(mine.table, space) == want
        assert other not in mine.table.ns_ids
        assert mine.table.nodes.keys() == full.table.nodes.keys()
    same_answers(c, mine, chains, r)


def entries_in(t: Table, ns_key: str) -> int:
    ns = t.ns_ids.get(ns_key)
    return sum(1 for s, k in enumerate(t.col.key) if k is not None and t.col.ns[s] == ns)


def first_event(stub: pb_grpc.PrefixDirectoryStub, req: pb.WatchRequest) -> pb.WatchEvent:
    for ev in stub.Watch(req, timeout=10):
        return ev
    raise AssertionError("the stream ended without an event")


@pytest.mark.timeout(120)
def test_refusals_and_a_stalled_reader(tmp_path: Path) -> None:
    limits = [
        *("--watch-limit", "buffer_entries_max=50", "--watch-limit", "history_entries_max=20"),
        *("--watch-limit", "stalled_cancel_ms=120000"),
    ]
    cluster = LocalCluster(str(tmp_path), size=1, extra_args=limits)
    try:
        cluster.start(30)
        r = cluster.replicas[0]
        # 30 s per call: clearing the 640k entries below took over 10 s on a
        # 2-core machine at load average 28.
        with cluster.client(timeout_s=30) as c, raw_stub(r.grpc_address) as stub:
            register(c, "watch-s")
            at = status(r).commit_index
            e = rpc_error(lambda: first_event(stub, pb.WatchRequest(from_index=at + 1000)))
            assert e.code() == grpc.StatusCode.OUT_OF_RANGE
            assert trailers(e)["kvdir-reason"] == "bad-from-index"
            bad = pb.WatchRequest(namespaces=[pb.Namespace(model="")])
            e = rpc_error(lambda: first_event(stub, bad))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT

            # A reader that stops reading: cut off once its buffer is full; the
            # replica keeps serving lookups and writes meanwhile.
            stalled = stub.Watch(pb.WatchRequest(), timeout=60)
            first = next(iter(stalled))
            assert first.WhichOneof("event") == "snapshot"
            for i in range(80):  # ~20 MB: past any flow-control window
                publish(c, "watch-s", 1, SPACE, chain(8000, salt=i))
            resp = c.lookup(SPACE, chain(1, salt=3))
            assert [m.node_id for m in resp.matches] == ["watch-s"]
            with pytest.raises(grpc.RpcError) as err:
                for _ in stalled:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "resume from index" in (err.value.details() or "")

            # A mirror resyncs after such a cut-off and ends up equal (the big
            # chains cleared first: a digest of 640k entries takes seconds).
            c.clear_node("watch-s", 1)
            m = Mirror()
            with MirrorSync(m, [r.grpc_address]):
                for i in range(200, 400):
                    publish(c, "watch-s", 1, SPACE, chain(1, salt=i))
                target = status(r).applied_index
                wait_for(lambda: m.applied_index >= target, 20, "the mirror to catch up", 0.02)
                d = c.call("ClusterStatus", pb.ClusterStatusRequest(with_digest=True))
                assert m.digest() == (d.applied_index, d.state_digest)
                via = MirroredDirectory(m, c).lookup(SPACE, chain(1, salt=250))
                assert via.read.replica_id == f"mirror:{r.replica_id}"
                assert [x.node_id for x in via.matches] == ["watch-s"]
    finally:
        cluster.stop()
