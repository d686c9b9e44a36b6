"""The PrefixDirectory servicer's own logic, driven through the in-process consensus port.

No sockets and no Raft: `DirectoryService` and `LeaseSweeper` are the real
ones, `MemoryCluster` (directory/consensus/memory.py) is the consensus, the
clock is a counter the test moves. `FakeContext` is a test double for
grpc's `ServicerContext` only: it records the abort code, details and
trailing metadata, and raises where grpc's `abort` raises.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
import pytest

from kvdir.core.client import lookup_request, namespace
from kvdir.core.mirror import Mirror
from kvdir.core.wire import namespace_key
from kvdir.directory.commands import BeginImport, Done, FreezeShard, Publish, RegisterNode, Tier
from kvdir.directory.config import DirectoryConfig, Peer
from kvdir.directory.consensus.memory import MemoryCluster
from kvdir.directory.consensus.port import Consensus, Outcome
from kvdir.directory.lookup import Chain
from kvdir.directory.metrics import DirectoryMetrics
from kvdir.directory.server import DirectoryService, LeaseSweeper
from kvdir.directory.shard_fence import key_of
from kvdir.v1 import directory_pb2 as pb

RAFT = ["127.0.0.1:7001", "127.0.0.1:7002"]
SPACE = namespace("port/model", 16, "bf16", "vllm-paged")
LEASE_MS = 1_000


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """Test double of grpc.ServicerContext: records what the servicer says."""

    def __init__(self, remaining_s: float | None = 5.0) -> None:
        self.remaining_s = remaining_s
        self.status: grpc.StatusCode | None = None
        self.trailing: dict[str, str] = {}

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self.status = code
        raise Aborted(code, details)

    def set_trailing_metadata(self, md: tuple[tuple[str, str], ...]) -> None:
        self.trailing.update(md)

    def time_remaining(self) -> float | None:
        return self.remaining_s

    def code(self) -> grpc.StatusCode | None:
        return self.status


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def now_ms(self) -> int:
        return self.ms


@pytest.fixture
def cluster() -> MemoryCluster:
    return MemoryCluster(RAFT)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def service(cluster: MemoryCluster, clock: Clock, replica: int = 0) -> DirectoryService:
    peers = tuple(Peer(f"r{i + 1}", a, f"127.0.0.1:{7101 + i}") for i, a in enumerate(RAFT))
    me = peers[replica]
    others = tuple(p for p in peers if p is not me)
    cfg = DirectoryConfig(me.replica_id, me.raft_address, me.grpc_address, "/nonexistent", others)
    return DirectoryService(cfg, cluster[RAFT[replica]], DirectoryMetrics(), clock)


def call(method: Any, request: Any, context: FakeContext | None = None) -> Any:
    return method(request, context or FakeContext())


def aborted(method: Any, request: Any, context: FakeContext | None = None) -> Aborted:
    ctx = context or FakeContext()
    with pytest.raises(Aborted) as info:
        method(request, ctx)
    assert ctx.status is info.value.code  # what the _rpc wrapper counts
    return info.value


def register(svc: DirectoryService, node: str = "n1", incarnation: int = 1) -> Any:
    req = pb.RegisterNodeRequest(
        node_id=node, host="h", agent_endpoint="h:9", incarnation=incarnation, lease_ms=LEASE_MS
    )
    return call(svc.RegisterNode, req)


def publish(svc: DirectoryService, hashes: list[bytes], node: str = "n1") -> Any:
    return call(svc.Publish, publish_request(hashes, node))


def publish_request(hashes: list[bytes], node: str = "n1") -> pb.PublishRequest:
    n = len(hashes)
    return pb.PublishRequest(
        node_id=node,
        incarnation=1,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=hashes,
        addresses=[0x1000 + i for i in range(n)],
        lengths=[4096] * n,
        rkeys=[7] * n,
        generations=[1] * n,
    )


def chain(n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in range(n)]


def holders(svc: DirectoryService, hashes: list[bytes], linearizable: bool = False) -> list[Any]:
    req = lookup_request(SPACE, hashes)
    req.linearizable = linearizable
    resp = call(svc.Lookup, req)
    return [(m.node_id, m.prefix_blocks) for m in resp.matches]


def test_publish_then_lookup_on_leader_and_follower(cluster: MemoryCluster, clock: Clock) -> None:
    leader, follower = service(cluster, clock, 0), service(cluster, clock, 1)
    reg = register(leader)
    assert reg.lease_expiry_ms == clock.ms + LEASE_MS  # stamped with the injected clock
    resp = publish(leader, chain(4))
    assert (resp.applied, resp.stale) == (4, 0)
    assert resp.applied_index == 2 == cluster[RAFT[1]].status().applied_index
    assert holders(leader, chain(6)) == [("n1", 4)]
    assert holders(follower, chain(6), linearizable=True) == [("n1", 4)]
    # A follower takes no write: not applied, and the hint names the leader (a write it
    # forwarded could reach the log after the client's retry and its next write).
    ctx = FakeContext()
    e = aborted(follower.Publish, publish_request([*chain(2), b"\xff" * 8]), ctx)
    assert e.code is grpc.StatusCode.UNAVAILABLE and "not the leader" in e.details
    assert ctx.trailing == {"kvdir-outcome": "not-applied", "kvdir-leader": "127.0.0.1:7101"}
    assert publish(leader, [*chain(2), b"\xff" * 8]).applied == 3
    status = call(follower.ClusterStatus, pb.ClusterStatusRequest(with_digest=True))
    assert (status.role, status.leader_grpc_address) == (pb.ROLE_FOLLOWER, "127.0.0.1:7101")
    assert status.applied_index == status.commit_index == 4  # 3 writes and 1 barrier


def test_lease_expiry_through_stamped_commands(cluster: MemoryCluster, clock: Clock) -> None:
    svc = service(cluster, clock)
    cfg = svc.cfg
    sweeper = LeaseSweeper(cluster[RAFT[0]], clock, cfg.lease_sweep_ms, svc.metrics, 1.0)
    register(svc)
    publish(svc, chain(3))
    sweeper.sweep_once()  # becomes the sweeping leader: every lease counts from now
    clock.ms += LEASE_MS - 1
    sweeper.sweep_once()
    assert holders(svc, chain(3)) == [("n1", 3)]  # a millisecond before expiry: still held
    call(svc.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation=1))
    clock.ms += LEASE_MS // 2
    sweeper.sweep_once()
    assert holders(svc, chain(3)) == [("n1", 3)]  # the heartbeat renewed it
    clock.ms += LEASE_MS
    sweeper.sweep_once()
    assert holders(svc, chain(3)) == []
    assert list(call(svc.ListNodes, pb.ListNodesRequest()).nodes) == []
    assert aborted(svc.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation=1)).code is (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_no_leader_is_unavailable_with_not_applied(cluster: MemoryCluster, clock: Clock) -> None:
    svc = service(cluster, clock)
    register(svc)
    cluster.elect(None)
    ctx = FakeContext()
    e = aborted(svc.Publish, pb.PublishRequest(), ctx)  # validation first: no blocks
    assert e.code is grpc.StatusCode.INVALID_ARGUMENT and ctx.trailing["kvdir-reason"]
    ctx = FakeContext()
    req = pb.RegisterNodeRequest(node_id="n2", host="h", incarnation=1)
    e = aborted(svc.RegisterNode, req, ctx)
    assert e.code is grpc.StatusCode.UNAVAILABLE and "no leader" in e.details
    assert ctx.trailing == {"kvdir-outcome": "not-applied", "kvdir-leader": ""}
    lookup = lookup_request(SPACE, chain(1))
    lookup.linearizable = True
    assert aborted(svc.Lookup, lookup).code is grpc.StatusCode.UNAVAILABLE
    cluster.elect(RAFT[1])  # the other replica leads: hints name its gRPC address
    ctx = FakeContext()
    e = aborted(svc.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation=1), ctx)
    assert e.code is grpc.StatusCode.UNAVAILABLE and "not the leader" in e.details
    assert ctx.trailing == {"kvdir-outcome": "not-applied", "kvdir-leader": "127.0.0.1:7102"}
    cluster.elect(RAFT[0])  # leading, and Raft says the write was not applied
    cluster.fail_next(Outcome.NOT_APPLIED, "the leader lost its term before appending")
    ctx = FakeContext()
    e = aborted(svc.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation=1), ctx)
    assert e.code is grpc.StatusCode.UNAVAILABLE and "lost its term" in e.details
    assert ctx.trailing == {"kvdir-outcome": "not-applied", "kvdir-leader": "127.0.0.1:7101"}


@pytest.mark.parametrize(
    ("remaining_s", "code"),
    [(5.0, grpc.StatusCode.ABORTED), (0.0, grpc.StatusCode.DEADLINE_EXCEEDED)],
    ids=["leader-changed", "deadline"],
)
def test_unknown_outcome_is_aborted_or_deadline(
    cluster: MemoryCluster, clock: Clock, remaining_s: float, code: grpc.StatusCode
) -> None:
    svc = service(cluster, clock)
    register(svc)
    cluster.fail_next(Outcome.UNKNOWN, "leader changed", applied=True)
    ctx = FakeContext(remaining_s)
    n = len(chain(2))
    req = pb.PublishRequest(
        node_id="n1",
        incarnation=1,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=chain(2),
        addresses=[1, 2],
        lengths=[1] * n,
        rkeys=[1] * n,
        generations=[1] * n,
    )
    e = aborted(svc.Publish, req, ctx)
    assert e.code is code and "outcome unknown" in e.details
    assert ctx.trailing["kvdir-outcome"] == "unknown"
    assert holders(svc, chain(2)) == [("n1", 2)]  # this "unknown" had in fact committed
    call(svc.Publish, req)  # the retry is idempotent
    assert holders(svc, chain(2)) == [("n1", 2)]


def test_a_held_replica_times_out_and_refuses_local_reads(
    cluster: MemoryCluster, clock: Clock
) -> None:
    follower = service(cluster, clock, 1)
    cluster.hold(RAFT[1])
    register(service(cluster, clock, 0))
    e = aborted(follower.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation=1))
    assert e.code is grpc.StatusCode.UNAVAILABLE  # only the leader takes a write
    lookup = lookup_request(SPACE, chain(1))
    lookup.linearizable = True
    e = aborted(follower.Lookup, lookup)
    assert e.code is grpc.StatusCode.UNAVAILABLE and "barrier" in e.details  # no outcome in time
    cluster.release(RAFT[1])
    assert follower.observe_catch_up()
    assert holders(follower, chain(1)) == []


def test_apply_listener_sees_every_entry_in_order(cluster: MemoryCluster, clock: Clock) -> None:
    seen: list[tuple[int, str]] = []
    cluster[RAFT[1]].add_apply_listener(lambda i, cmd, _res: seen.append((i, type(cmd).__name__)))
    svc = service(cluster, clock)
    register(svc)
    publish(svc, chain(2))
    holders(svc, chain(2), linearizable=True)
    assert seen == [(1, "RegisterNode"), (2, "Publish"), (3, "Barrier")]
    cap = cluster[RAFT[1]].capture(1.0)
    assert (cap.index, cap.term, cap.members) == (3, 1, RAFT)


def test_the_port_stays_narrow() -> None:
    """The verbs every implementation must provide (a new one is a decision, not a drift)."""
    assert sorted(Consensus.__abstractmethods__) == [
        "add_apply_listener",
        "add_member",
        "barrier",
        "capture",
        "close",
        "members",
        "propose",
        "read",
        "remove_member",
        "status",
        "transfer_leadership",
    ]


def test_a_lookup_of_a_shard_the_log_has_fenced_is_refused(
    cluster: MemoryCluster, clock: Clock
) -> None:
    """Frozen (moving away, maybe partly dropped) or still importing: the table's own
    fence decides, after the barrier, whatever map the replica routes by (found by
    the simulator of groups, seed 27). Other keys are answered as before."""
    leader, follower = service(cluster, clock, 0), service(cluster, clock, 1)
    register(leader)
    publish(leader, chain(4))
    key = key_of(chain(4)[2])
    res = cluster[RAFT[0]].write(FreezeShard(9, key, key + 1), 1.0)
    assert res.outcome is Outcome.COMMITTED and res.result == Done()
    for svc in (leader, follower):
        for linearizable in (False, True):
            req = lookup_request(SPACE, chain(4))
            req.linearizable = linearizable
            ctx = FakeContext()
            e = aborted(svc.Lookup, req, ctx)
            assert e.code is grpc.StatusCode.FAILED_PRECONDITION
            assert "shard 9 is moving away" in e.details
            assert ctx.trailing["kvdir-reason"] == "shard_moving"
            batch = pb.LookupBatchRequest(lookups=[lookup_request(SPACE, chain(2)), req])
            assert aborted(svc.LookupBatch, batch).code is grpc.StatusCode.FAILED_PRECONDITION
            assert holders(svc, chain(2), linearizable) == [("n1", 2)]  # outside the fence


def test_a_mirror_answers_no_lookup_of_a_fenced_shard() -> None:
    m = Mirror()
    ns = namespace_key(SPACE)
    for cmd in (
        RegisterNode("n1", "h", "h:9", ("tcp",), 1, LEASE_MS, 0),
        Publish("n1", 1, ns, int(Tier.GPU), chain(4), [1, 2, 3, 4], [8] * 4, [7] * 4, [1] * 4),
    ):
        m.table.apply(cmd)
    with m.lock:
        assert [x.prefix_blocks for x in m.matches(ns, Chain.of(chain(4)), 8)] == [4]
    key = key_of(chain(4)[1])
    m.table.apply(BeginImport(3, key, key + 1))
    with m.lock:
        assert m.matches(ns, Chain.of(chain(4)), 8) == []
        assert [x.prefix_blocks for x in m.matches(ns, Chain.of(chain(1)), 8)] == [1]
