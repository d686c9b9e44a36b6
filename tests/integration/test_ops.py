"""What operators and orchestrators touch: health, reflection, metrics and the CLI."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster, Replica, free_ports, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.integration.helpers import (
    chain,
    followers,
    ns,
    prefixes,
    publish,
    raw_stub,
    register,
    rpc_error,
    trailers,
    wait_converged,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SERVICE = "kvdir.v1.PrefixDirectory"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(r: Replica, service: str = "") -> int:
    """The replica's answer to grpc.health.v1.Health/Check (-1 if it does not answer)."""
    with grpc.insecure_channel(r.grpc_address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return -1
    return int(resp.status)


def serving_everywhere(r: Replica, status: int) -> bool:
    return health(r) == status and health(r, SERVICE) == status


# ------------------------------------------------------------------- health


@pytest.mark.timeout(90)
@pytest.mark.parametrize("survivor_role", ["leader", "follower"])
def test_health_and_writes_without_quorum(cluster: LocalCluster, survivor_role: str) -> None:
    for r in cluster.replicas:
        wait_for(functools.partial(serving_everywhere, r, SERVING), 5, f"{r.replica_id} SERVING")
    space = ns("ops/no-quorum")
    blocks = chain(6, salt=30)
    with cluster.client(timeout_s=10) as c:
        register(c, "nq-node")
        publish(c, "nq-node", 1, space, blocks)
    wait_converged(cluster)

    leader = cluster.wait_leader(10)
    survivor = leader if survivor_role == "leader" else followers(cluster)[0]
    for r in cluster.replicas:
        if r is not survivor:
            cluster.kill(r, signal.SIGKILL)

    # No quorum: the survivor loses its leader (a leader steps down after
    # leader_fallback_s) and says so to health checkers.
    wait_for(
        lambda: serving_everywhere(survivor, NOT_SERVING),
        5,
        f"{survivor.replica_id} to report NOT_SERVING without a quorum",
    )
    with raw_stub(survivor.grpc_address) as stub:
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        assert st.role != pb.ROLE_LEADER
        assert st.leader_id == ""
        assert not st.has_quorum
        assert sum(m.connected for m in st.members if not m.is_self) == 0

        # Writes are refused at once, never left hanging, and say they were not applied.
        writes = [
            (
                "Publish",
                pb.PublishRequest(
                    node_id="nq-node",
                    incarnation=1,
                    namespace=space,
                    tier=pb.TIER_GPU,
                    block_hashes=chain(1, salt=31),
                    addresses=[1],
                    lengths=[1],
                    rkeys=[1],
                    generations=[1],
                ),
            ),
            ("RegisterNode", pb.RegisterNodeRequest(node_id="nq-2", host="h", incarnation=1)),
            ("Heartbeat", pb.HeartbeatRequest(node_id="nq-node", incarnation=1)),
            ("ClearNode", pb.ClearNodeRequest(node_id="nq-node", incarnation=1)),
        ]
        for method, req in writes:
            t0 = time.monotonic()
            e = rpc_error(functools.partial(getattr(stub, method), req, timeout=5))
            took = time.monotonic() - t0
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (method, e.code(), e.details())
            assert trailers(e).get("kvdir-outcome") == "not-applied", method
            assert took < 1.0, f"{method} took {took:.2f}s to be refused"
        # A linearizable read needs a quorum too ...
        lin = pb.LookupRequest(namespace=space, block_hashes=blocks, linearizable=True)
        e = rpc_error(lambda: stub.Lookup(lin, timeout=5))
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        # ... while a local read still answers from the replica's table.
        local = stub.Lookup(pb.LookupRequest(namespace=space, block_hashes=blocks), timeout=5)
        assert prefixes(local) == [("nq-node", 6)]
        assert local.read.replica_id == survivor.replica_id


# --------------------------------------------------------------- reflection


@pytest.mark.timeout(30)
def test_reflection_lists_the_services(shared_cluster: LocalCluster) -> None:
    r = shared_cluster.replicas[0]
    with grpc.insecure_channel(r.grpc_address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        answers = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    assert len(answers) == 2
    names = {s.name for s in answers[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert any(n.startswith("grpc.reflection.") for n in names)
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in answers[1].file_descriptor_response.file_descriptor_proto
    ]
    services = {f"{f.package}.{s.name}": s for f in files for s in f.service}
    assert SERVICE in services
    methods = {m.name for m in services[SERVICE].method}
    assert {"Publish", "Lookup", "LookupBatch", "RegisterNode", "ClusterStatus"} <= methods


# ------------------------------------------------------------------ metrics


def scrape(r: Replica) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of the replica's /metrics, by sample name."""
    with urllib.request.urlopen(f"http://{r.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    found = [v for lb, v in samples.get(name, []) if all(lb.get(k) == x for k, x in labels.items())]
    assert found, f"no sample {name}{labels}"
    return sum(found)


@pytest.mark.timeout(60)
def test_prometheus_metrics(shared_cluster: LocalCluster) -> None:
    space = ns("ops/metrics")
    blocks = chain(12, salt=32)
    leader = shared_cluster.wait_leader(10)
    with DirectoryClient([leader.grpc_address], timeout_s=10) as c:
        register(c, "metrics-node")
        publish(c, "metrics-node", 1, space, blocks)
        for _ in range(3):
            assert prefixes(c.lookup(space, blocks)) == [("metrics-node", 12)]
        with raw_stub(leader.grpc_address) as stub:
            bad = pb.LookupRequest(namespace=space, block_hashes=[])
            assert rpc_error(lambda: stub.Lookup(bad, timeout=5)).code() == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
    st = wait_converged(shared_cluster)

    for r in shared_cluster.replicas:
        m = scrape(r)
        role = value(m, "kvdir_directory_raft_role")
        assert role == (2 if r is leader else 0), r.replica_id
        assert value(m, "kvdir_directory_entries") == st[r.replica_id].entries
        assert value(m, "kvdir_directory_raft_applied_index") == st[r.replica_id].applied_index
        assert value(m, "kvdir_directory_raft_has_leader") == 1
        assert "kvdir_directory_rpcs_total" in m

    m = scrape(leader)
    assert value(m, "kvdir_directory_rpcs_total", method="Publish", code="OK") >= 1
    assert value(m, "kvdir_directory_rpcs_total", method="RegisterNode", code="OK") >= 1
    assert value(m, "kvdir_directory_rpcs_total", method="Lookup", code="OK") >= 3
    assert value(m, "kvdir_directory_rpcs_total", method="Lookup", code="INVALID_ARGUMENT") >= 1
    assert value(m, "kvdir_directory_write_outcomes_total", outcome="committed") >= 2
    assert value(m, "kvdir_directory_rpc_seconds_count", method="Lookup") >= 3


# ---------------------------------------------------------------------- CLI


def kvdir(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.timeout(60)
def test_ctl_status(shared_cluster: LocalCluster) -> None:
    wait_converged(shared_cluster)
    addrs = ",".join(shared_cluster.grpc_addresses)
    out = kvdir("ctl", "status", "--addr", addrs)
    assert out.returncode == 0, out.stderr
    table, _, members = out.stdout.strip().partition("\n\nMEMBERS (3, as seen by ")
    assert sorted(line.split()[1] for line in members.splitlines()[1:]) == ["r1", "r2", "r3"]
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["ADDRESS", "REPLICA", "ROLE"]
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == 3
    assert sorted(row[1] for row in rows) == ["r1", "r2", "r3"]
    assert [row[0] for row in rows] == shared_cluster.grpc_addresses
    roles = [row[2] for row in rows]
    assert roles.count("leader") == 1
    assert roles.count("follower") == 2
    leader_id = rows[roles.index("leader")][1]
    assert {row[-1] for row in rows} == {leader_id}

    js = kvdir("ctl", "status", "--addr", addrs, "--json")
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert sorted(doc) == sorted(shared_cluster.grpc_addresses)
    assert sum(1 for s in doc.values() if s.get("role") == "ROLE_LEADER") == 1


@pytest.mark.timeout(60)
def test_ctl_lookup_and_nodes(shared_cluster: LocalCluster) -> None:
    space = ns("ops/ctl")
    ids = [11, 12, 13]
    with shared_cluster.client(timeout_s=10) as c:
        register(c, "ctl-node")
        publish(c, "ctl-node", 1, space, [i.to_bytes(8, "big") for i in ids])
    addrs = ",".join(shared_cluster.grpc_addresses)
    out = kvdir(
        "ctl",
        "lookup",
        "--addr",
        addrs,
        "--model",
        space.model,
        "--block-tokens",
        str(space.block_tokens),
        "--dtype",
        space.dtype,
        "--layout",
        space.layout,
        "--ids",
        "11,12,13,99",
        "--linearizable",
    )
    assert out.returncode == 0, out.stderr
    assert "linearizable" in out.stdout.splitlines()[0]
    assert "ctl-node: 3 blocks" in out.stdout
    nodes = kvdir("ctl", "nodes", "--addr", addrs)
    assert nodes.returncode == 0, nodes.stderr
    assert any(line.split()[0] == "ctl-node" for line in nodes.stdout.splitlines()[1:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["lookup", "status"])
def test_ctl_against_nothing_fails_with_one_line(command: str) -> None:
    (port,) = free_ports(1)
    args = ["ctl", command, "--addr", f"127.0.0.1:{port}", "--timeout", "1"]
    if command == "lookup":
        args += ["--model", "m", "--block-tokens", "16", "--ids", "1,2"]
    t0 = time.monotonic()
    out = kvdir(*args)
    assert time.monotonic() - t0 < 30
    assert out.returncode == 1, (out.stdout, out.stderr)
    err = out.stderr.splitlines()
    assert len(err) == 1, out.stderr
    assert err[0].startswith("kvdir: error:"), err[0]
    assert out.stdout == ""
