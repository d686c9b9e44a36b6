"""Agents over mutual TLS: peers authenticate before they learn rkeys or QPs.

Real agent processes against the TLS directory of conftest.py. Agents a and b
hold certificates of the cluster CA (CN = node id); agent t accepts peers by
bearer token instead (require_client_cert = false), so a TLS client without
any credential reaches its handler and must be refused there.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient
from kvdir.core.security import ClientSecurity
from kvdir.core.wire import LOOKUP_SOCKET_SUFFIX
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from tests.agent.helpers import (
    FRESH,
    NS,
    POOL_SPEC,
    SERVED,
    SLOT_BYTES,
    WAIT_S,
    chain_of,
    launch_all,
    scrape,
    slot_bytes,
    stop_all,
    store_chain,
    wait_prefix,
)
from tests.integration.helpers import rpc_error
from tests.security.conftest import Pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def agents(
    secure_cluster: LocalCluster, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, LocalAgent]]:
    base = tmp_path_factory.mktemp("secure-agents")
    token_cfg = Path(base, "token-mode.toml")
    token_cfg.write_text("[tls]\nrequire_client_cert = false\n")
    spec = {
        "node-a": pki.leaves["node-a"].daemon_flags(),
        "node-b": pki.leaves["node-b"].daemon_flags(),
        "node-c": [
            "--config",
            str(token_cfg),
            *pki.leaves["node-c"].daemon_flags(),
            "--tokens-file",
            pki.tokens_file,
        ],
    }
    out = {
        n: LocalAgent(
            n,
            str(base),
            secure_cluster.grpc_addresses,
            POOL_SPEC,
            transports="tcp",
            lease_ms=15_000,
            extra_args=flags,
        )
        for n, flags in spec.items()
    }
    try:
        launch_all(out.values())
        yield out
    finally:
        stop_all(out.values())


def _handshake(endpoint: str, sec: ClientSecurity, as_node: str) -> apb.HandshakeResponse:
    with sec.channel(endpoint) as ch:
        resp: apb.HandshakeResponse = apb_grpc.AgentStub(ch).Handshake(
            apb.HandshakeRequest(version=1, node_id=as_node), timeout=5
        )
        return resp


def _connect_rdma(endpoint: str, sec: ClientSecurity, as_node: str, holder: str) -> object:
    req = apb.ConnectRdmaRequest(version=1, node_id=as_node, holder_node_id=holder)
    with sec.channel(endpoint) as ch:
        return apb_grpc.AgentStub(ch).ConnectRdma(req, timeout=5)


def test_secure_agents_fetch_real_bytes_over_mtls(
    secure_cluster: LocalCluster, pki: Pki, agents: dict[str, LocalAgent]
) -> None:
    chain = chain_of(901, 6)
    a = EngineClient(agents["node-a"].engine_socket)
    b = EngineClient(agents["node-b"].engine_socket)
    try:
        _, payload = store_chain(a, chain, seed=901)
        with DirectoryClient(
            secure_cluster.grpc_addresses, security=pki.leaves["admin"].client()
        ) as c:
            wait_prefix(secure_cluster, c, chain, "node-a", len(chain), readers=[b])
        dst = b.allocate(NS, len(chain)).slots
        metrics = agents["node-b"].metrics_address
        wait_for(lambda: scrape(metrics)[FRESH] == 1, WAIT_S, "node-b's mirror over mTLS")
        served = scrape(metrics)[SERVED]
        r = b.fetch(NS, chain, dst)
        assert (r.valid_blocks, r.source_node, r.transport) == (len(chain), "node-a", "tcp")
        assert r.bytes == len(chain) * SLOT_BYTES
        assert [slot_bytes(b, s) for s in dst] == payload
        assert scrape(metrics)[SERVED] == served + 1  # its Watch stream runs over mTLS
    finally:
        a.close()
        b.close()


def test_an_authenticated_peer_gets_the_handshake(pki: Pki, agents: dict[str, LocalAgent]) -> None:
    resp = _handshake(agents["node-a"].listen, pki.leaves["node-b"].client(), "node-b")
    assert resp.node_id == "node-a"
    assert resp.pools and resp.pools[0].rkey


def test_no_handshake_without_a_trusted_certificate(
    pki: Pki, agents: dict[str, LocalAgent]
) -> None:
    ep = agents["node-a"].listen
    for sec in (
        ClientSecurity(),  # plaintext
        ClientSecurity(ca=pki.leaves["node-b"].ca),  # TLS, no client certificate
        pki.rogue["node-a"].client(),  # a certificate of another CA
    ):
        e = rpc_error(partial(_handshake, ep, sec, "node-b"))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, sec
        e = rpc_error(partial(_connect_rdma, ep, sec, "node-b", "node-a"))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, sec


def test_a_peer_may_not_handshake_under_another_name(
    pki: Pki, agents: dict[str, LocalAgent]
) -> None:
    ep = agents["node-a"].listen
    e = rpc_error(lambda: _handshake(ep, pki.leaves["node-b"].client(), "node-c"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'node-b' may not handshake as 'node-c'" in (e.details() or "")
    e = rpc_error(lambda: _connect_rdma(ep, pki.leaves["node-b"].client(), "node-c", "node-a"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not connect a queue pair as 'node-c'" in (e.details() or "")


def test_token_mode_refuses_missing_and_wrong_tokens(
    pki: Pki, agents: dict[str, LocalAgent]
) -> None:
    ep = agents["node-c"].listen
    ca = pki.leaves["node-a"].ca
    e = rpc_error(lambda: _handshake(ep, ClientSecurity(ca=ca), "node-a"))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no credentials" in (e.details() or "")
    e = rpc_error(lambda: _connect_rdma(ep, ClientSecurity(ca=ca), "node-a", "node-c"))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = ClientSecurity(ca=ca, token="node-a.wrong")
    e = rpc_error(lambda: _handshake(ep, bad, "node-a"))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token rejected" in (e.details() or "")
    good = ClientSecurity(ca=ca, token=pki.tokens["node-a"])
    assert _handshake(ep, good, "node-a").node_id == "node-c"


def test_the_engine_socket_is_for_its_owner_and_group(agents: dict[str, LocalAgent]) -> None:
    sock = agents["node-a"].engine_socket
    for path in (sock, sock + LOOKUP_SOCKET_SUFFIX):  # and its lookup socket, alike
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o007 == 0, (path, oct(mode))


def test_the_tcp_data_plane_is_tls_for_certified_peers_only(
    pki: Pki, agents: dict[str, LocalAgent]
) -> None:
    """A reader that knows the rkey and the address still gets no byte in clear."""
    import socket
    import ssl

    from bench.fuzz.targets import read_request
    from kvdir.agent.pool import Geometry
    from kvdir.transfer.tcp import _HEAD

    HEAD_BYTES = _HEAD.size  # noqa: N806

    hs = _handshake(agents["node-a"].listen, pki.leaves["node-b"].client(), "node-b")
    tcp = next(t for t in hs.transports if t.name == "tcp")
    assert tcp.params["tls"] == "1"
    host, _, port = tcp.params["endpoint"].rpartition(":")
    info = hs.pools[0]
    base = info.header_address - Geometry.of(info.slot_bytes, info.slots).header_offset
    request = read_request([(base, info.rkey, 64)])

    def exchange(s: socket.socket) -> bytes:
        s.sendall(request)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
            if len(out) >= HEAD_BYTES + 64:
                break
        return out

    def answer(wrap: ssl.SSLContext | None) -> bytes:
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            if wrap is None:
                return exchange(raw)
            with wrap.wrap_socket(raw, server_hostname=host) as s:
                return exchange(s)

    try:
        clear = answer(None)
    except ConnectionResetError:
        clear = b""
    assert b"KVDT" not in clear  # the holder spoke TLS (an alert) or hung up

    certified = ssl.create_default_context(cafile=pki.leaves["node-b"].ca)
    certified.load_cert_chain(pki.leaves["node-b"].cert, pki.leaves["node-b"].key)
    got = answer(certified)
    with open(info.path, "rb") as pool_file:
        first = pool_file.read(64)
    assert (got[:4], got[5], got[HEAD_BYTES:]) == (b"KVDT", 0, first), "certified reads work"

    uncertified = ssl.create_default_context(cafile=pki.leaves["node-b"].ca)
    try:
        got = answer(uncertified)  # TLS 1.3 reports the refusal on the first read
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        got = b""
    assert b"KVDT" not in got, "a reader without a client certificate was served"
