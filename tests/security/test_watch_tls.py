"""Watch over mutual TLS: a mirror follows with any identity, an unknown caller gets nothing.

Real replica processes (tests/security/conftest.py). Watch is authorised as a
lookup is (any authenticated identity may read); every refusal is checked for
its status and reason, and the replica keeps serving the others meanwhile.
"""

from __future__ import annotations

from functools import partial

import grpc
import pytest

from kvdir.core.client import DirectoryClient, lookup_request, namespace
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.security import ClientSecurity
from kvdir.local import LocalCluster, wait_for
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc
from tests.integration.helpers import rpc_error
from tests.security.conftest import Pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = namespace("security-watch", 16)
H = [bytes([0x40 + i]) * 16 for i in range(1, 9)]
SYNC_S = 20.0


def _first_event(addr: str, sec: ClientSecurity) -> pb.WatchEvent:
    """Open a Watch and read one event (the snapshot's first chunk)."""
    with sec.channel(addr) as ch:
        call = pb_grpc.PrefixDirectoryStub(ch).Watch(pb.WatchRequest(), timeout=5)
        try:
            return next(iter(call))
        finally:
            call.cancel()  # type: ignore[no-untyped-call]


def _publish_as_node_a(cluster: LocalCluster, pki: Pki) -> int:
    with DirectoryClient(cluster.grpc_addresses, security=pki.leaves["node-a"].client()) as c:
        c.register_node("node-a", "127.0.0.1", 1, endpoint="127.0.0.1:1", transports=["tcp"])
        n = len(H)
        res = c.publish(
            "node-a",
            1,
            NS,
            pb.TIER_HOST,
            H,
            [4096 * (i + 1) for i in range(n)],
            [4096] * n,
            [7] * n,
            [1] * n,
        )
        return int(res.applied_index)


def test_a_mirror_follows_over_mtls_and_answers_as_the_rpc(
    secure_cluster: LocalCluster, pki: Pki
) -> None:
    at = _publish_as_node_a(secure_cluster, pki)
    reader = pki.leaves["node-b"].client()  # an identity that owns nothing: reads only
    mirror = Mirror()
    with MirrorSync(mirror, secure_cluster.grpc_addresses, security=reader):
        wait_for(lambda: mirror.applied_index >= at, SYNC_S, f"the mirror to reach index {at}")
        got = mirror.lookup(NS, H)
    with DirectoryClient(secure_cluster.grpc_addresses, security=reader) as c:
        want = c.lookup(NS, H, linearizable=True)
    assert [(m.node_id, m.prefix_blocks) for m in got.matches] == [("node-a", len(H))]
    assert list(got.matches) == list(want.matches)  # same records, same format


def test_watch_with_a_certificate_and_its_token(secure_cluster: LocalCluster, pki: Pki) -> None:
    sec = pki.leaves["node-b"].client(pki.tokens["node-b"])
    ev = _first_event(secure_cluster.grpc_addresses[0], sec)
    assert ev.WhichOneof("event") == "snapshot"


def test_unauthenticated_watchers_are_refused_and_the_replica_keeps_serving(
    secure_cluster: LocalCluster, pki: Pki
) -> None:
    addr = secure_cluster.grpc_addresses[0]
    ca = pki.leaves["node-b"].ca
    leaf = pki.leaves["node-a"]
    refusals = (
        # A token that does not check out, or names another identity than the certificate.
        (leaf.client("node-a.not-the-secret"), grpc.StatusCode.UNAUTHENTICATED, "token"),
        (leaf.client(pki.tokens["node-b"]), grpc.StatusCode.UNAUTHENTICATED, "certificate"),
        # TLS without a client certificate, or one from a CA nobody trusts: no handshake.
        (ClientSecurity(ca=ca), grpc.StatusCode.UNAVAILABLE, ""),
        (pki.rogue["node-a"].client(), grpc.StatusCode.UNAVAILABLE, ""),
    )
    for sec, code, why in refusals:
        e = rpc_error(partial(_first_event, addr, sec))
        assert e.code() == code, (sec, e.details())
        assert why in (e.details() or "").lower(), e.details()
    with grpc.insecure_channel(addr) as ch:  # plaintext to a TLS port
        call = pb_grpc.PrefixDirectoryStub(ch).Watch(pb.WatchRequest(), timeout=5)
        e = rpc_error(lambda: next(iter(call)))
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    # The replica still serves reads and a legitimate watcher.
    reader = pki.leaves["node-b"].client()
    with DirectoryClient([addr], security=reader) as c:
        c.lookup_batch([lookup_request(NS, H)])
    assert _first_event(addr, reader).WhichOneof("event") == "snapshot"
