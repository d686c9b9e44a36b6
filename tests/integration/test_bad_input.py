"""Malformed and refused requests over real gRPC, sent with bare stubs (no client checks)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import Message

from kvdir.core.client import DirectoryClient, DirectoryError
from kvdir.directory.limits import RequestLimits
from kvdir.local import LocalCluster, Replica
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    chain,
    followers,
    ns,
    prefixes,
    publish,
    raw_stub,
    register,
    rpc_error,
    status,
    trailers,
    wait_all_connected,
    wait_local_prefixes,
)

pytestmark = pytest.mark.integration

LIMITS = RequestLimits()
NODE = "bad-input-node"
INCARNATION = 3
SPACE = ns("bad-input/model")
GOOD = chain(4, salt=20)


def _publish(**overrides: object) -> pb.PublishRequest:
    fields: dict[str, object] = {
        "node_id": NODE,
        "incarnation": INCARNATION,
        "namespace": SPACE,
        "tier": pb.TIER_GPU,
        "block_hashes": GOOD,
        "addresses": [1, 2, 3, 4],
        "lengths": [4096] * 4,
        "rkeys": [7] * 4,
        "generations": [1] * 4,
    }
    fields.update(overrides)
    return pb.PublishRequest(**fields)  # type: ignore[arg-type]


def _lookup(**overrides: object) -> pb.LookupRequest:
    fields: dict[str, object] = {"namespace": SPACE, "block_hashes": GOOD}
    fields.update(overrides)
    return pb.LookupRequest(**fields)  # type: ignore[arg-type]


def _register(**overrides: object) -> pb.RegisterNodeRequest:
    fields: dict[str, object] = {"node_id": "bad-reg", "host": "127.0.0.1", "incarnation": 1}
    fields.update(overrides)
    return pb.RegisterNodeRequest(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    method: str
    request: Message
    reason: str
    through_raft: bool = False
    """Refused by the state machine (costs a log entry), not by validation."""


ids_over_chain = list(range(LIMITS.chain_blocks_max + 1))
CASES: dict[str, Case] = {
    "publish-empty-model": Case(
        "Publish", _publish(namespace=pb.Namespace(block_tokens=16)), "bad-namespace"
    ),
    "publish-block-tokens-0": Case(
        "Publish", _publish(namespace=pb.Namespace(model="m")), "bad-namespace"
    ),
    "publish-tp-rank-over-size": Case(
        "Publish",
        _publish(namespace=pb.Namespace(model="m", block_tokens=16, tp_rank=2, tp_size=2)),
        "bad-namespace",
    ),
    "publish-33-byte-hash": Case(
        "Publish", _publish(block_hashes=[*GOOD[:3], b"\x01" * 33]), "bad-hashes"
    ),
    "publish-empty-hash": Case("Publish", _publish(block_hashes=[*GOOD[:3], b""]), "bad-hashes"),
    "publish-hashes-and-ids": Case("Publish", _publish(block_ids=[1, 2, 3, 4]), "bad-hashes"),
    "publish-no-blocks": Case(
        "Publish",
        _publish(block_hashes=[], addresses=[], lengths=[], rkeys=[], generations=[]),
        "bad-batch",
    ),
    "publish-over-batch-limit": Case(
        "Publish",
        _publish(block_hashes=[], block_ids=list(range(LIMITS.batch_entries_max + 1))),
        "too-many-blocks",
    ),
    "publish-short-addresses": Case("Publish", _publish(addresses=[1, 2, 3]), "bad-batch"),
    "publish-long-generations": Case("Publish", _publish(generations=[1, 1, 1, 1, 1]), "bad-batch"),
    "publish-missing-rkeys": Case("Publish", _publish(rkeys=[]), "bad-batch"),
    "publish-tier-unspecified": Case("Publish", _publish(tier=pb.TIER_UNSPECIFIED), "bad-tier"),
    "publish-tier-unknown-value": Case("Publish", _publish(tier=9), "bad-tier"),
    "publish-no-node-id": Case("Publish", _publish(node_id=""), "bad-node-id"),
    "publish-unknown-node": Case(
        "Publish", _publish(node_id="never-registered"), "unknown-node", through_raft=True
    ),
    "publish-stale-incarnation": Case(
        "Publish", _publish(incarnation=INCARNATION - 1), "stale-incarnation", through_raft=True
    ),
    "lookup-empty-model": Case(
        "Lookup", _lookup(namespace=pb.Namespace(block_tokens=16)), "bad-namespace"
    ),
    "lookup-block-tokens-0": Case(
        "Lookup", _lookup(namespace=pb.Namespace(model="m")), "bad-namespace"
    ),
    "lookup-33-byte-hash": Case("Lookup", _lookup(block_hashes=[b"\x02" * 33]), "bad-hashes"),
    "lookup-hashes-and-ids": Case("Lookup", _lookup(block_ids=[1]), "bad-hashes"),
    "lookup-chain-over-limit": Case(
        "Lookup", _lookup(block_hashes=[], block_ids=ids_over_chain), "too-many-blocks"
    ),
    "lookup-empty-chain": Case("Lookup", _lookup(block_hashes=[]), "bad-chain"),
    "lookup-max-nodes-over-limit": Case(
        "Lookup", _lookup(max_nodes=LIMITS.lookup_nodes_max + 1), "bad-max-nodes"
    ),
    "lookup-linearizable-bad-chain": Case(
        "Lookup", _lookup(block_hashes=[b""], linearizable=True), "bad-hashes"
    ),
    "batch-over-limit": Case(
        "LookupBatch",
        pb.LookupBatchRequest(lookups=[_lookup()] * (LIMITS.lookup_batch_max + 1)),
        "too-many-lookups",
    ),
    "batch-one-bad-lookup": Case(
        "LookupBatch",
        pb.LookupBatchRequest(lookups=[_lookup(), _lookup(max_nodes=1000), _lookup()]),
        "bad-max-nodes",
    ),
    "register-incarnation-0": Case("RegisterNode", _register(incarnation=0), "bad-incarnation"),
    "register-lease-too-small": Case("RegisterNode", _register(lease_ms=499), "bad-lease"),
    "register-lease-too-long": Case("RegisterNode", _register(lease_ms=600_001), "bad-lease"),
    "register-no-host": Case("RegisterNode", _register(host=""), "bad-host"),
    "register-no-node-id": Case("RegisterNode", _register(node_id=""), "bad-node-id"),
    "register-node-id-too-long": Case("RegisterNode", _register(node_id="n" * 129), "bad-node-id"),
    "register-too-many-transports": Case(
        "RegisterNode", _register(transports=[f"t{i}" for i in range(9)]), "bad-transports"
    ),
    "register-empty-transport": Case(
        "RegisterNode", _register(transports=["tcp", ""]), "bad-transports"
    ),
    "heartbeat-unknown-node": Case(
        "Heartbeat",
        pb.HeartbeatRequest(node_id="never-registered", incarnation=1),
        "unknown-node",
        through_raft=True,
    ),
    "heartbeat-no-node-id": Case("Heartbeat", pb.HeartbeatRequest(), "bad-node-id"),
    "remove-generations-mismatch": Case(
        "Remove",
        pb.RemoveRequest(
            node_id=NODE,
            incarnation=INCARNATION,
            namespace=SPACE,
            tier=pb.TIER_GPU,
            block_hashes=GOOD,
            generations=[1],
        ),
        "bad-batch",
    ),
    "remove-unknown-node": Case(
        "Remove",
        pb.RemoveRequest(
            node_id="never-registered",
            incarnation=1,
            namespace=SPACE,
            tier=pb.TIER_GPU,
            block_hashes=GOOD,
        ),
        "unknown-node",
        through_raft=True,
    ),
    "clear-unknown-node": Case(
        "ClearNode",
        pb.ClearNodeRequest(node_id="never-registered", incarnation=1),
        "unknown-node",
        through_raft=True,
    ),
    "clear-bad-namespace": Case(
        "ClearNode",
        pb.ClearNodeRequest(
            node_id=NODE, incarnation=INCARNATION, namespace=pb.Namespace(model="m")
        ),
        "bad-namespace",
    ),
}


def _call(
    stub: pb_grpc.PrefixDirectoryStub, case: Case, timeout_s: float = 10
) -> Callable[[], object]:
    method: Callable[..., object] = getattr(stub, case.method)
    return lambda: method(case.request, timeout=timeout_s)


@pytest.fixture(scope="module")
def registered(shared_cluster: LocalCluster) -> LocalCluster:
    """`shared_cluster` with NODE registered and holding GOOD."""
    with shared_cluster.client(timeout_s=10) as c:
        register(c, NODE, INCARNATION)
        publish(c, NODE, INCARNATION, SPACE, GOOD)
    return shared_cluster


def _assert_refused(r: Replica, name: str, case: Case) -> None:
    with raw_stub(r.grpc_address) as stub:
        e = rpc_error(_call(stub, case))
    where = f"{name} on {r.replica_id}"
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (where, e.code(), e.details())
    assert (e.details() or "").strip(), where
    assert trailers(e).get("kvdir-reason") == case.reason, (where, trailers(e))


@pytest.mark.timeout(90)
def test_malformed_requests_are_invalid_argument_with_a_reason(registered: LocalCluster) -> None:
    leader = registered.wait_leader(10)
    before = status(leader)
    for name, case in CASES.items():
        if not case.through_raft:
            for r in registered.replicas:
                _assert_refused(r, name, case)
    # Validation refuses before proposing: not one log entry for all of that.
    after = status(leader)
    assert after.term == before.term, "a leader change during the test; rerun"
    assert after.commit_index == before.commit_index
    assert after.log_entries == before.log_entries


@pytest.mark.timeout(90)
def test_state_machine_refusals_are_invalid_argument_with_a_reason(
    registered: LocalCluster,
) -> None:
    leader = registered.wait_leader(10)
    for name, case in CASES.items():
        if case.through_raft:
            _assert_refused(leader, name, case)
            for r in followers(registered):  # a follower takes no write: it names the leader
                with raw_stub(r.grpc_address) as stub:
                    e = rpc_error(_call(stub, case))
                where = f"{name} on {r.replica_id}"
                assert e.code() == grpc.StatusCode.UNAVAILABLE, (where, e.code(), e.details())
                assert trailers(e) == {
                    "kvdir-outcome": "not-applied",
                    "kvdir-leader": leader.grpc_address,
                }, where


@pytest.mark.timeout(60)
def test_server_still_serves_after_bad_input(registered: LocalCluster) -> None:
    # Everything that was refused left the table as it was ...
    with registered.client(timeout_s=10) as c:
        for r in registered.replicas:
            lin = c.lookup(SPACE, GOOD, address=r.grpc_address, linearizable=True)
            assert prefixes(lin) == [(NODE, 4)], r.replica_id
        assert "never-registered" not in {n.node_id for n in c.list_nodes().nodes}
        assert "bad-reg" not in {n.node_id for n in c.list_nodes().nodes}
        # ... and the replicas keep taking writes and answering lookups.
        more = chain(50, salt=21)
        register(c, "after-bad-input")
        publish(c, "after-bad-input", 1, SPACE, more)
        for r in registered.replicas:
            lin = c.lookup(SPACE, more, address=r.grpc_address, linearizable=True)
            assert prefixes(lin) == [("after-bad-input", 50)]
        wait_local_prefixes(c, registered.replicas, SPACE, more, [("after-bad-input", 50)])
        wait_all_connected(registered)


def _publish_codes(r: Replica) -> dict[str, float]:
    """kvdir_directory_rpcs_total{method="Publish"} of replica `r`, by code."""
    url = f"http://{r.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvdir_directory_rpcs_total{") and 'method="Publish"' in line:
            code = line.split('code="', 1)[1].split('"', 1)[0]
            out[code] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(90)
def test_short_deadline_on_a_write_is_deadline_exceeded_or_ok(registered: LocalCluster) -> None:
    leader = registered.wait_leader(10)
    term = status(leader).term
    follower = followers(registered)[0]
    deadlines_s = [0.0001, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.05]
    blocks = chain(len(deadlines_s) * 4, salt=22)
    seen: dict[grpc.StatusCode, int] = {}
    k = 0
    # Bounded: 2 replicas x 2 rounds x 8 deadlines = 32 writes.
    for r in (leader, follower):
        with raw_stub(r.grpc_address) as stub:
            for _ in range(2):
                for deadline_s in deadlines_s:
                    req = _publish(
                        block_hashes=[blocks[k]],
                        addresses=[k],
                        lengths=[1],
                        rkeys=[1],
                        generations=[1],
                    )
                    k += 1
                    t0 = time.monotonic()
                    try:
                        stub.Publish(req, timeout=deadline_s)
                        code = grpc.StatusCode.OK
                    except grpc.RpcError as e:
                        code = e.code()
                    took = time.monotonic() - t0
                    # A follower takes no write: refused at once, unless the deadline
                    # passed first.
                    ok = grpc.StatusCode.OK if r is leader else grpc.StatusCode.UNAVAILABLE
                    assert code in (ok, grpc.StatusCode.DEADLINE_EXCEEDED), (
                        r.replica_id,
                        deadline_s,
                        code,
                    )
                    assert took < deadline_s + 2.0, f"a {deadline_s}s write took {took:.2f}s"
                    seen[code] = seen.get(code, 0) + 1
    assert seen.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) > 0, seen

    # The writes whose outcome was unknown are idempotent: republishing settles them all.
    with registered.client(timeout_s=10) as c:
        for i, b in enumerate(blocks):
            c.publish(NODE, INCARNATION, SPACE, pb.TIER_GPU, [b], [i], [1], [1], [1])
        for i, b in enumerate(blocks):
            got = c.lookup(SPACE, [b], linearizable=True)
            assert prefixes(got) == [(NODE, 1)], i
        assert prefixes(c.lookup(SPACE, GOOD, linearizable=True)) == [(NODE, 4)]

    # A write that ran out of the caller's deadline on the server is counted as
    # DEADLINE_EXCEEDED there, never as ABORTED (no leader changed meanwhile).
    assert status(leader).term == term, "leader changed; rerun"
    for r in (leader, follower):
        assert _publish_codes(r).get("ABORTED", 0) == 0, (r.replica_id, _publish_codes(r))


@pytest.mark.timeout(30)
def test_client_never_retries_invalid_argument(registered: LocalCluster) -> None:
    with DirectoryClient(registered.grpc_addresses, timeout_s=10) as c:
        req = pb.RegisterNodeRequest(node_id="x", host="h", incarnation=1, lease_ms=1)
        with pytest.raises(DirectoryError) as info:
            c.call("RegisterNode", req)
        assert c.retries == 0
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.reason == "bad-lease"
    assert "lease_ms" in str(info.value)
