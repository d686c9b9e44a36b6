"""The agent's lookup socket (agent/lookup_socket.py): the engine's Lookup and Fetch
without gRPC.

Real agents (the trio: `kvdir agent serve` processes) and a real 3-replica
directory. The socket must answer exactly what the gRPC Lookup answers,
refuse bad input with a status and keep serving, bound its connections, and
the engine library must fall back to gRPC where the socket (or its fetch frames)
is not there and fail (not hang) where the agent does not answer in time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
import threading
import time

import grpc
import pytest

from kvdir.agent.engine.client import EngineClient, EngineError, PoolChanged, Refused, _LookupSocket
from kvdir.agent.pool import STALE_EPOCH
from kvdir.core.client import DirectoryClient
from kvdir.core.wire import (
    FRAME_FETCH,
    FRAME_LENGTH_MASK,
    FRAME_METHOD_SHIFT,
    LOOKUP_ANSWER_HEADER,
    LOOKUP_REQUEST_HEADER,
    LOOKUP_SOCKET_SUFFIX,
)
from kvdir.local import LocalCluster
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb
from tests.agent.conftest import Trio
from tests.agent.helpers import NS, chain_of, scrape, slot_bytes, store_chain, wait_prefix

pytestmark = pytest.mark.integration

BLOCKS = 5
CONNECTIONS_MAX = 64  # agent/lookup_socket.py's bound (the test imports no daemon code)


def _path(trio: Trio, name: str) -> str:
    return trio.agents[name].engine_socket + LOOKUP_SOCKET_SUFFIX


def _frame(
    sock: socket.socket, body: bytes, length: int | None = None, method: int = 0
) -> tuple[int, bytes]:
    """One raw request and its answer: (status code number, payload)."""
    n = len(body) if length is None else length
    sock.sendall(LOOKUP_REQUEST_HEADER.pack(method << FRAME_METHOD_SHIFT | n) + body)
    head = sock.recv(LOOKUP_ANSWER_HEADER.size, socket.MSG_WAITALL)
    code, n = LOOKUP_ANSWER_HEADER.unpack(head)
    return code, sock.recv(n, socket.MSG_WAITALL) if n else b""


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


@pytest.mark.timeout(120)
def test_the_socket_answers_what_grpc_answers_and_refuses_alike(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(1300, BLOCKS)
    store_chain(trio.a, chain, seed=1300)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    over_grpc = EngineClient(trio.agents["c"].engine_socket, lookup_socket=False)
    try:
        lean = trio.c.lookup(NS, chain)
        assert trio.c._lookups is not None and trio.c._lookups.fallbacks == 0
        assert lean == over_grpc.lookup(NS, chain)  # peers, ticket, path, epoch alike
        assert [(p.node_id, p.prefix_blocks) for p in lean.peers] == [("a", BLOCKS)]
        # A stale epoch and an unknown namespace: the same exceptions as over gRPC.
        stale = apb.EngineLookupRequest(namespace=NS, block_hashes=chain, epoch=lean.epoch ^ 1)
        with _connect(_path(trio, "c")) as s:
            code, msg = _frame(s, stale.SerializeToString())
            assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert msg.decode().startswith(STALE_EPOCH)
        other = pb.Namespace(model="not-served", block_tokens=NS.block_tokens)
        raw = apb.EngineLookupRequest(namespace=other, block_hashes=chain)
        assert trio.c._lookups is not None
        with pytest.raises(Refused, match="no pool for namespace"):
            trio.c._lookups.ask(raw, 5.0)
        with pytest.raises(Refused, match="no pool for namespace"):
            over_grpc._call("Lookup", raw)
        with pytest.raises(PoolChanged):
            trio.c._lookups.ask(stale, 5.0)
    finally:
        over_grpc.close()


@pytest.mark.timeout(120)
def test_bad_frames_are_refused_and_the_agent_keeps_serving(trio: Trio) -> None:
    good = apb.EngineLookupRequest(namespace=NS, block_hashes=chain_of(1301, 2))
    with _connect(_path(trio, "b")) as s:
        code, msg = _frame(s, b"\xff\xff\xff garbage")
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], msg
        assert b"not an EngineLookupRequest" in msg
        code, _ = _frame(s, good.SerializeToString())  # the same connection goes on
        assert code == 0
        code, msg = _frame(s, b"\x01\x02", method=7)  # no such method: refused, kept
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"method 7" in msg, msg
        code, msg = _frame(s, b"\xff\xff\xff", method=FRAME_FETCH)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"not a FetchRequest" in msg
        code, _ = _frame(s, good.SerializeToString())
        assert code == 0
        code, msg = _frame(s, b"", length=FRAME_LENGTH_MASK)  # over the bound: refused, closed
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"over" in msg
        assert s.recv(1) == b""
    with _connect(_path(trio, "b")) as s:  # a new connection is served
        assert _frame(s, good.SerializeToString())[0] == 0
    assert trio.b.lookup(NS, chain_of(1301, 2)).epoch


@pytest.mark.timeout(120)
def test_connections_past_the_bound_are_closed_and_the_engine_asks_over_grpc(
    trio: Trio,
) -> None:
    req = apb.EngineLookupRequest(namespace=NS, block_hashes=chain_of(1302, 1))
    held = [_connect(_path(trio, "b")) for _ in range(CONNECTIONS_MAX + 1)]
    try:
        served = 0
        for s in held:  # each in turn: the agent took them in this order
            with contextlib.suppress(ConnectionError, struct.error):  # closed unanswered
                served += _frame(s, req.SerializeToString())[0] == 0
        # The trio's own client for b may hold one connection already (one thread).
        assert CONNECTIONS_MAX - 1 <= served <= CONNECTIONS_MAX, served
        refused = "kvdir_agent_lookup_socket_refused_connections_total"
        assert scrape(trio.agents["b"].metrics_address).get(refused, 0.0) >= 1.0
        late = EngineClient(trio.agents["b"].engine_socket)
        try:
            assert late._lookups is not None
            assert late.lookup(NS, chain_of(1302, 1)).epoch  # answered over gRPC
            assert late._lookups.fallbacks == 1
        finally:
            late.close()
    finally:
        for s in held:
            s.close()


@pytest.mark.timeout(60)
def test_an_agent_that_never_answers_fails_the_lookup_in_time() -> None:
    """A stand-in listener (not an agent) that accepts and never answers: the engine
    library's lookup must raise within its timeout and drop the connection."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.sock" + LOOKUP_SOCKET_SUFFIX)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
        accepted: list[socket.socket] = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
        t.start()
        ls = _LookupSocket(path)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="Lookup"):
            ls.ask(apb.EngineLookupRequest(namespace=NS), 0.3)
        assert time.monotonic() - t0 < 5.0
        assert not ls._open  # dropped: its stream is out of step
        ls.close()
        for s in accepted:
            s.close()
        listener.close()
    # No socket at all (an older agent): None, so the caller asks over gRPC.
    missing = _LookupSocket("/nonexistent/kvdir.sock" + LOOKUP_SOCKET_SUFFIX)
    assert missing.ask(apb.EngineLookupRequest(namespace=NS), 0.3) is None
    assert missing.fallbacks == 1


@pytest.mark.timeout(120)
def test_a_fetch_frame_answers_what_grpc_answers_and_refuses_alike(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(1303, BLOCKS)
    _, payload = store_chain(trio.a, chain, seed=1303)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    over_grpc = EngineClient(trio.agents["c"].engine_socket, lookup_socket=False)
    ls = trio.c._lookups
    assert ls is not None
    try:
        framed, plain = trio.c.allocate(NS, BLOCKS).slots, over_grpc.allocate(NS, BLOCKS).slots
        fallbacks = ls.fallbacks
        a = trio.c.fetch(NS, chain, framed, ticket=trio.c.lookup(NS, chain).ticket)
        b = over_grpc.fetch(NS, chain, plain, ticket=over_grpc.lookup(NS, chain).ticket)
        assert ls.fetch_frames and ls.fallbacks == fallbacks  # the frame was answered
        assert (a.valid_blocks, a.source_node, a.transport, a.bytes, a.epoch) == (
            b.valid_blocks, b.source_node, b.transport, b.bytes, b.epoch
        )  # fmt: skip
        assert a.valid_blocks == BLOCKS
        assert [slot_bytes(trio.c, s) for s in framed] == payload
        assert [slot_bytes(over_grpc, s) for s in plain] == payload
        # Slots this engine does not hold, a stale epoch: the gRPC method's refusals.
        gone = trio.c.allocate(NS, BLOCKS).slots
        trio.c.free(NS, gone)
        with pytest.raises(Refused, match="does not hold"):
            trio.c.fetch(NS, chain, gone)
        with pytest.raises(Refused, match="does not hold"):
            over_grpc.fetch(NS, chain, gone)
        stale = apb.FetchRequest(namespace=NS, block_hashes=chain, epoch=a.epoch ^ 1)
        with pytest.raises(PoolChanged):
            ls.fetch(stale, 5.0)
        assert ls.fetch_frames
        trio.c.free(NS, framed)
        over_grpc.free(NS, plain)
    finally:
        over_grpc.close()


@pytest.mark.timeout(60)
def test_an_agent_without_fetch_frames_is_asked_over_grpc() -> None:
    """A stand-in for an agent from before fetch frames (not an agent): it read every
    request header as a length, so a fetch frame's is over its bound; it refuses it
    as such and closes. The engine library's fetch answers None (the caller asks
    over gRPC) and never sends it another fetch frame; lookups go on."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.sock" + LOOKUP_SOCKET_SUFFIX)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
        ok = apb.EngineLookupResponse(local_blocks=1, epoch=7).SerializeToString()

        def old_agent() -> None:
            while True:
                try:
                    conn = listener.accept()[0]
                except OSError:
                    return
                with conn:
                    while head := conn.recv(4, socket.MSG_WAITALL):
                        (length,) = LOOKUP_REQUEST_HEADER.unpack(head)
                        if length > 64 << 20:
                            msg = f"frame of {length} B is over {64 << 20} B".encode()
                            conn.sendall(LOOKUP_ANSWER_HEADER.pack(3, len(msg)) + msg)
                            break
                        conn.recv(length, socket.MSG_WAITALL) if length else b""
                        conn.sendall(LOOKUP_ANSWER_HEADER.pack(0, len(ok)) + ok)

        t = threading.Thread(target=old_agent, daemon=True)
        t.start()
        ls = _LookupSocket(path)
        try:
            fetch = apb.FetchRequest(namespace=NS, block_hashes=chain_of(1304, 2), slots=[0, 1])
            assert ls.fetch(fetch, 5.0) is None
            assert not ls.fetch_frames and not ls._open  # dropped: the agent closed it
            assert ls.fetch(fetch, 5.0) is None  # not sent again
            answer = ls.ask(apb.EngineLookupRequest(namespace=NS), 5.0)
            assert answer is not None and answer.epoch == 7
        finally:
            ls.close()
            listener.close()
