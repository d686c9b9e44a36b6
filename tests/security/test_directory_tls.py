"""The directory over mutual TLS: who gets in, who may write for which node.

Real replica processes (tests/security/conftest.py); every refusal is checked
for its status code and a message that says why.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdir.core.client import DirectoryClient, namespace
from kvdir.core.security import ClientSecurity, may_act_for
from kvdir.local import LocalCluster
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc
from tests.integration.helpers import rpc_error
from tests.security.conftest import Pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NS = namespace("security-tier", 16)
H = [bytes([i]) * 16 for i in range(1, 5)]


def _stub_call(addr: str, sec: ClientSecurity, method: str, req: object) -> object:
    with sec.channel(addr) as ch:
        return getattr(pb_grpc.PrefixDirectoryStub(ch), method)(req, timeout=5)


def _register(c: DirectoryClient, node: str, incarnation: int = 1) -> None:
    c.register_node(node, "127.0.0.1", incarnation, endpoint="127.0.0.1:1", transports=["tcp"])


def _publish(c: DirectoryClient, node: str, incarnation: int = 1) -> pb.PublishResponse:
    n = len(H)
    return c.publish(
        node,
        incarnation,
        NS,
        pb.TIER_HOST,
        H,
        [4096 * (i + 1) for i in range(n)],
        [4096] * n,
        [7] * n,
        [1] * n,
    )


def test_a_node_writes_for_itself_over_mtls(secure_cluster: LocalCluster, pki: Pki) -> None:
    with DirectoryClient(
        secure_cluster.grpc_addresses, security=pki.leaves["node-a"].client()
    ) as c:
        _register(c, "node-a")
        assert _publish(c, "node-a").applied == len(H)
        found = c.lookup(NS, H, linearizable=True)
        assert [(m.node_id, m.prefix_blocks) for m in found.matches] == [("node-a", len(H))]
        # The node's engine holders ("<node>/<engine>/dp<rank>") are its own too.
        _register(c, "node-a/vllm0/dp0")


def test_a_node_may_not_write_for_another(secure_cluster: LocalCluster, pki: Pki) -> None:
    addr = secure_cluster.grpc_addresses[0]
    a = pki.leaves["node-a"].client()
    for method, req in (
        ("RegisterNode", pb.RegisterNodeRequest(node_id="node-b", host="h", incarnation=1)),
        ("Publish", pb.PublishRequest(node_id="node-b", incarnation=1, namespace=NS)),
        ("Remove", pb.RemoveRequest(node_id="node-b", incarnation=1, namespace=NS)),
        ("Heartbeat", pb.HeartbeatRequest(node_id="node-b", incarnation=1)),
        ("ClearNode", pb.ClearNodeRequest(node_id="node-b", incarnation=1, deregister=True)),
        # A prefix of another name is not that node's holder.
        ("RegisterNode", pb.RegisterNodeRequest(node_id="node-ab", host="h", incarnation=1)),
    ):
        e = rpc_error(partial(_stub_call, addr, a, method, req))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, method
        assert "'node-a' may not act for node" in (e.details() or ""), e.details()


def test_an_admin_may_act_for_any_node(secure_cluster: LocalCluster, pki: Pki) -> None:
    with DirectoryClient(secure_cluster.grpc_addresses, security=pki.leaves["admin"].client()) as c:
        _register(c, "node-c", 5)
        assert _publish(c, "node-c", 5).applied == len(H)
        assert c.clear_node("node-c", 5, deregister=True).removed == len(H)


def test_reads_need_only_an_identity(secure_cluster: LocalCluster, pki: Pki) -> None:
    with DirectoryClient(
        secure_cluster.grpc_addresses, security=pki.leaves["node-b"].client()
    ) as c:
        assert c.list_nodes().read.replica_id
        c.lookup(NS, H)


def test_a_plaintext_client_is_refused(secure_cluster: LocalCluster) -> None:
    addr = secure_cluster.grpc_addresses[0]
    with grpc.insecure_channel(addr) as ch:
        e = rpc_error(
            lambda: pb_grpc.PrefixDirectoryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5)
        )
    assert e.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", ["admin", "node-a"])
def test_a_certificate_from_another_ca_is_refused(
    secure_cluster: LocalCluster, pki: Pki, who: str
) -> None:
    addr = secure_cluster.grpc_addresses[0]
    e = rpc_error(
        lambda: _stub_call(addr, pki.rogue[who].client(), "ListNodes", pb.ListNodesRequest())
    )
    assert e.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails


def test_tls_without_a_client_certificate_is_refused(
    secure_cluster: LocalCluster, pki: Pki
) -> None:
    addr = secure_cluster.grpc_addresses[0]
    sec = ClientSecurity(ca=pki.leaves["admin"].ca)
    e = rpc_error(lambda: _stub_call(addr, sec, "ListNodes", pb.ListNodesRequest()))
    assert e.code() == grpc.StatusCode.UNAVAILABLE


def test_a_wrong_token_is_refused_with_a_reason(secure_cluster: LocalCluster, pki: Pki) -> None:
    addr = secure_cluster.grpc_addresses[0]
    leaf = pki.leaves["node-a"]
    for token, why in (
        ("node-a.not-the-secret", "bearer token rejected"),
        ("nobody.whatever", "bearer token rejected"),
        ("no-dot-at-all", "bearer token rejected"),
        (
            pki.tokens["node-b"],
            "the token names 'node-b' but the client certificate names 'node-a'",
        ),
    ):
        e = rpc_error(
            partial(_stub_call, addr, leaf.client(token), "ListNodes", pb.ListNodesRequest())
        )
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, token
        assert why in (e.details() or ""), e.details()
    # The right token with the matching certificate is accepted.
    _stub_call(addr, leaf.client(pki.tokens["node-a"]), "ListNodes", pb.ListNodesRequest())


def test_health_stays_open_to_probes_over_tls(secure_cluster: LocalCluster, pki: Pki) -> None:
    """kubelet / wait-ready probe without an identity; they learn only SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addr = secure_cluster.grpc_addresses[0]
    with pki.leaves["node-b"].client().channel(addr) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_raft_listens_only_on_the_cluster_address(secure_cluster: LocalCluster) -> None:
    host, port = secure_cluster.replicas[0].raft_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        pass
    # pysyncobj's default would bind 0.0.0.0, reachable on every address.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", int(port)), timeout=5).close()


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_ctl_talks_tls_and_fails_in_one_line_without_it(
    secure_cluster: LocalCluster, pki: Pki
) -> None:
    addrs = ",".join(secure_cluster.grpc_addresses)
    admin = pki.leaves["admin"]
    ok = _ctl("nodes", "--addr", addrs, "--ca", admin.ca, "--cert", admin.cert, "--key", admin.key)
    assert ok.returncode == 0, ok.stderr
    assert "NODE" in ok.stdout
    plain = _ctl("nodes", "--addr", addrs, "--timeout", "1")
    assert plain.returncode == 1
    assert plain.stderr.startswith("kvdir: error: ") and plain.stderr.count("\n") == 1
    token_no_tls = _ctl("nodes", "--addr", addrs, "--token", "x.y")
    assert token_no_tls.returncode == 1
    assert "needs --ca" in token_no_tls.stderr


NODE_IDS = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["node-a", "node-a/", "node-a/vllm0/dp0", "node-a-x", "node-b", "admin"]),
    st.text(max_size=12).map(lambda t: "node-a/" + t),
    st.text(max_size=12).map(lambda t: "node-a" + t),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_id=NODE_IDS)
def test_writes_are_allowed_exactly_for_the_callers_own_ids(
    secure_cluster: LocalCluster, pki: Pki, node_id: str
) -> None:
    addr = secure_cluster.wait_leader(10).grpc_address  # a follower takes no write
    req = pb.RegisterNodeRequest(node_id=node_id, host="127.0.0.1", incarnation=1)
    try:
        _stub_call(addr, pki.leaves["node-a"].client(), "RegisterNode", req)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    if may_act_for("node-a", node_id, ()):
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), node_id
    else:
        assert code == grpc.StatusCode.PERMISSION_DENIED, node_id


def test_membership_and_backups_are_for_admins_only(
    secure_cluster: LocalCluster, pki: Pki, tmp_path: Path
) -> None:
    """A node's identity may write its own entries, never change the cluster."""
    addr = secure_cluster.grpc_addresses[0]
    node = pki.leaves["node-a"].client()
    for method, req, what in (
        ("AddReplica", pb.AddReplicaRequest(raft_address="127.0.0.1:1"), "add replicas"),
        ("RemoveReplica", pb.RemoveReplicaRequest(raft_address="127.0.0.1:1"), "remove replicas"),
    ):
        with node.channel(addr) as ch:
            stub = pb_grpc.DirectoryAdminStub(ch)
            e = rpc_error(partial(getattr(stub, method), req, timeout=5))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, method
        assert f"'node-a' may not {what}" in (e.details() or ""), e.details()
    with node.channel(addr) as ch:
        stream = pb_grpc.DirectoryAdminStub(ch).Backup(pb.BackupRequest(), timeout=5)
        e = rpc_error(lambda: list(stream))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    # The admin's certificate takes a backup through `kvdir ctl backup` over TLS.
    admin = pki.leaves["admin"]
    out = f"{tmp_path}/dir.backup"
    done = _ctl(
        "backup", "--out", out, "--addr", addr,
        "--ca", admin.ca, "--cert", admin.cert, "--key", admin.key,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "backup of" in done.stdout
    refused = _ctl(
        "backup", "--out", out + ".2", "--addr", addr, "--timeout", "5",
        "--ca", admin.ca, "--cert", pki.leaves["node-a"].cert, "--key", pki.leaves["node-a"].key,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "may not take backups" in refused.stderr
