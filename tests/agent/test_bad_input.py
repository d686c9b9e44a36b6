"""Bad input over the real sockets: clear errors, and the agent keeps serving.

Engine-side requests go through raw `kvdir.v1.Engine` stubs on the agent's
Unix socket (so the library's own checks are bypassed); peer-side reads go
through a raw `TcpChannel` to the holder's data port, found with a real
`kvdir.v1.Agent` handshake over TCP.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvdir.core.client import DirectoryClient, namespace
from kvdir.local import LocalCluster
from kvdir.transfer.base import AccessDenied, Read
from kvdir.transfer.memory import PAGE_BYTES
from kvdir.transfer.tcp import TcpChannel
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    NS,
    SLOT_BYTES,
    SLOTS,
    chain_of,
    slot_bytes,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def engine_stub(trio: Trio) -> Iterator[apb_grpc.EngineStub]:
    with grpc.insecure_channel(f"unix:{trio.agents['a'].engine_socket}") as ch:
        yield apb_grpc.EngineStub(ch)


def _refused(call: Callable[[], object], code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    e = err.value
    assert isinstance(e, grpc.Call)
    assert e.code() == code, e.details()
    assert text in (e.details() or ""), e.details()


@pytest.mark.timeout(120)
def test_bad_engine_requests_get_clear_errors(
    agent_cluster: LocalCluster,
    directory: DirectoryClient,
    trio: Trio,
    engine_stub: apb_grpc.EngineStub,
) -> None:
    stub = engine_stub
    bad = grpc.StatusCode.INVALID_ARGUMENT
    other = namespace("no-such-model", 16)
    h = chain_of(500, 3)

    _refused(
        lambda: stub.Allocate(apb.AllocateRequest(namespace=other, count=1), timeout=10),
        bad,
        "no pool for namespace model='no-such-model'",
    )
    _refused(
        lambda: stub.Lookup(apb.EngineLookupRequest(namespace=other, block_hashes=h), timeout=10),
        bad,
        "no pool for namespace",
    )
    _refused(
        lambda: stub.Fetch(
            apb.FetchRequest(namespace=other, block_hashes=h, slots=[0, 1, 2]), timeout=10
        ),
        bad,
        "no pool for namespace",
    )
    _refused(
        lambda: stub.Free(apb.FreeRequest(namespace=other, slots=[0]), timeout=10),
        bad,
        "no pool for namespace",
    )

    _refused(
        lambda: stub.Fetch(
            apb.FetchRequest(namespace=NS, block_hashes=h, slots=[0, 1]), timeout=10
        ),
        bad,
        "3 blocks but 2 destination slots",
    )
    _refused(
        lambda: stub.Fetch(
            apb.FetchRequest(namespace=NS, block_hashes=h, slots=[0, 1, 1]), timeout=10
        ),
        bad,
        "destination slots repeat",
    )
    _refused(
        lambda: stub.Fetch(
            apb.FetchRequest(namespace=NS, block_hashes=h[:1], slots=[SLOTS]), timeout=10
        ),
        bad,
        f"slot {SLOTS} is outside the pool (0..{SLOTS - 1})",
    )
    _refused(
        lambda: stub.Free(apb.FreeRequest(namespace=NS, slots=[SLOTS + 7]), timeout=10),
        bad,
        f"slot {SLOTS + 7} is outside the pool",
    )

    _refused(
        lambda: stub.Allocate(apb.AllocateRequest(namespace=NS, count=SLOTS + 1), timeout=10),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"asked for {SLOTS + 1} slots",
    )
    _refused(
        lambda: stub.Allocate(apb.AllocateRequest(namespace=NS, count=0), timeout=10),
        bad,
        "count must be > 0",
    )

    _refused(
        lambda: stub.Notify(
            apb.NotifyRequest(
                namespace=NS, stored_hashes=h, stored_slots=[0, 1], stored_generations=[1, 1, 1]
            ),
            timeout=10,
        ),
        bad,
        "notification columns differ",
    )
    _refused(
        lambda: stub.Notify(
            apb.NotifyRequest(namespace=NS, removed_hashes=h[:2], removed_slots=[0, 1]), timeout=10
        ),
        bad,
        "notification columns differ",
    )
    _refused(
        lambda: stub.Notify(apb.NotifyRequest(namespace=other), timeout=10),
        bad,
        "no pool for namespace",
    )

    # Notifications that do not match the slot headers are dropped, not published.
    stub.Notify(
        apb.NotifyRequest(
            namespace=NS,
            stored_hashes=h,
            stored_slots=[0, SLOTS + 5, 2**31],
            stored_generations=[999_999, 1, 1],
        ),
        timeout=10,
    )
    assert (
        stub.Lookup(apb.EngineLookupRequest(namespace=NS, block_hashes=h), timeout=10).local_blocks
        == 0
    )

    _still_serves(agent_cluster, directory, trio, salt=501)


@pytest.mark.timeout(120)
def test_a_tcp_reader_is_held_to_its_grant(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    holder = trio.agents["a"]
    with grpc.insecure_channel(holder.listen) as ch:
        peer = apb_grpc.AgentStub(ch)
        _refused(
            lambda: peer.Handshake(apb.HandshakeRequest(version=99, node_id="x"), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION,
            "wire version 99 is not supported",
        )
        hs = peer.Handshake(
            apb.HandshakeRequest(version=1, node_id="probe", transports=["tcp"]), timeout=10
        )
    assert hs.node_id == "a"
    endpoint = next(t.params["endpoint"] for t in hs.transports if t.name == "tcp")
    (info,) = hs.pools
    assert (info.slot_bytes, info.slots) == (SLOT_BYTES, SLOTS)
    base = info.header_address - PAGE_BYTES  # the region is the whole pool file
    end = info.data_address + info.slots * info.slot_bytes
    key = info.rkey

    chain = chain_of(510, 2)
    slots, payload = store_chain(trio.a, chain, seed=510)
    first = info.data_address + slots[0] * SLOT_BYTES

    dst = memoryview(bytearray(SLOT_BYTES))
    ch_tcp = TcpChannel(endpoint)
    try:
        denied = [
            ([Read(end, key, 64, 0)], "outside the region"),
            ([Read(end - 32, key, 64, 0)], "outside the region"),
            ([Read(base - 64, key, 64, 0)], "outside the region"),
            ([Read(first, key ^ 0x5A5A, 64, 0)], "was never granted"),
            ([Read(first, 0, 64, 0)], "was never granted"),
            # One bad segment refuses the whole batch.
            ([Read(first, key, 64, 0), Read(end, key, 64, 64)], "outside the region"),
        ]
        for reads, why in denied:
            with pytest.raises(AccessDenied, match=why):
                ch_tcp.read(reads, dst, 10.0)
        # The same channel reconnects and reads what it was granted, byte for byte.
        assert ch_tcp.read([Read(first, key, SLOT_BYTES, 0)], dst, 10.0) == SLOT_BYTES
        assert bytes(dst) == payload[0]
    finally:
        ch_tcp.close()

    # A request head that is not the protocol gets a refusal, then a hang-up...
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(struct.pack("<4sBBHIQ", b"GET ", 1, 1, 0, 0, 7))
        got = b""
        while chunk := raw.recv(4096):
            got += chunk
        magic, _, status, _, _, req_id, n = struct.unpack_from("<4sBBHIQI", got)
        assert (magic, status, req_id) == (b"KVDT", 2, 7)  # STATUS_BAD_REQUEST
        assert got[24 : 24 + n] == b"not a kvdir tcp read request of this version"
    # ...and so does a burst of garbage (a reset is a fine way to hang up too).
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(4096))
        with contextlib.suppress(ConnectionResetError):
            while raw.recv(4096):
                pass

    wait_prefix(agent_cluster, directory, chain, "a", 2, readers=[trio.b])
    dst_slots = trio.b.allocate(NS, 2).slots
    r = trio.b.fetch(NS, chain, dst_slots)
    assert (r.valid_blocks, r.transport) == (2, "tcp")
    assert [slot_bytes(trio.b, s) for s in dst_slots] == payload
    trio.b.free(NS, dst_slots)
    trio.a.free(NS, slots)


def _still_serves(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio, salt: int
) -> None:
    chain = chain_of(salt, 3)
    slots, payload = store_chain(trio.a, chain, seed=salt)
    wait_prefix(agent_cluster, directory, chain, "a", 3, readers=[trio.b, trio.c])
    for reader in ("b", "c"):
        e = trio.engines[reader]
        dst = e.allocate(NS, 3).slots
        r = e.fetch(NS, chain, dst)
        assert r.valid_blocks == 3, reader
        assert [slot_bytes(e, s) for s in dst] == payload
        e.free(NS, dst)
    trio.a.free(NS, slots)
