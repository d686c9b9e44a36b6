"""The shm backend: a reader maps the holder's pool file read-only (shared memory only).

The holder and the reader here are two mappings of one file in a temporary
directory, as they are two processes on one host in production.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdir.transfer.base import AccessDenied, PeerUnavailable, Read, Region
from kvdir.transfer.engine import Descriptor, TransferEngine
from kvdir.transfer.memory import PAGE_BYTES, SharedMemory
from kvdir.transfer.shm import ShmChannel, ShmTransport, host_identity

SIZE = 16 * PAGE_BYTES


@dataclass
class Holder:
    mem: SharedMemory
    view: memoryview
    transport: ShmTransport
    region: Region

    def descriptor(self) -> dict[str, str]:
        return self.transport.descriptor()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    mem = SharedMemory.create(str(tmp_path / "kvdir-holder-pool0"), SIZE)
    view = mem.view()
    view[:] = random.Random(11).randbytes(SIZE)
    transport = ShmTransport([mem])
    region = transport.register(view)
    try:
        yield Holder(mem, view, transport, region)
    finally:
        transport.close()
        view.release()
        mem.close()


def test_descriptor_names_the_file_the_region_and_the_host(holder: Holder) -> None:
    d = holder.descriptor()
    assert d["transport"] == "shm"
    assert d["host_id"] == host_identity()
    (spec,) = json.loads(d["regions"])
    assert spec == {
        "path": holder.mem.path,
        "inode": os.stat(holder.mem.path).st_ino,
        "address": holder.region.address,
        "length": SIZE,
        "rkey": holder.region.rkey,
    }


def test_reads_copy_the_holders_bytes(holder: Holder) -> None:
    ch = ShmChannel(holder.descriptor())
    try:
        base, key = holder.region.address, holder.region.rkey
        dst = memoryview(bytearray(3 * PAGE_BYTES))
        reads = [
            Read(base + 5 * PAGE_BYTES, key, PAGE_BYTES, 2 * PAGE_BYTES),
            Read(base, key, PAGE_BYTES, 0),
            Read(base + PAGE_BYTES, key, 100, PAGE_BYTES),
        ]
        assert ch.read(reads, dst, 1.0) == 2 * PAGE_BYTES + 100
        v = holder.view
        assert bytes(dst[:PAGE_BYTES]) == bytes(v[:PAGE_BYTES])
        assert bytes(dst[PAGE_BYTES : PAGE_BYTES + 100]) == bytes(v[PAGE_BYTES : PAGE_BYTES + 100])
        assert bytes(dst[2 * PAGE_BYTES :]) == bytes(v[5 * PAGE_BYTES : 6 * PAGE_BYTES])
        # The mapping is live: what the holder writes next is what the next read sees.
        v[0:4] = b"NEW!"
        ch.read([Read(base, key, 4, 0)], dst, 1.0)
        assert bytes(dst[:4]) == b"NEW!"
    finally:
        ch.close()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spans=st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 3 * PAGE_BYTES)), max_size=8)
)
def test_any_batch_inside_the_region_lands_byte_for_byte(
    holder: Holder, spans: list[tuple[int, int]]
) -> None:
    ch = ShmChannel(holder.descriptor())
    try:
        reads, pos = [], 0
        for off, want in spans:
            n = min(want, SIZE - off)
            reads.append(Read(holder.region.address + off, holder.region.rkey, n, pos))
            pos += n
        dst = memoryview(bytearray(max(pos, 1)))
        assert ch.read(reads, dst, 1.0) == pos
        for r in reads:
            off = r.remote_address - holder.region.address
            assert bytes(dst[r.dst_offset : r.dst_offset + r.length]) == bytes(
                holder.view[off : off + r.length]
            )
    finally:
        ch.close()


@pytest.mark.parametrize(
    ("offset", "length", "rkey_xor", "match"),
    [
        (0, 8, 1, "was never granted"),
        (-8, 8, 0, "fall outside"),
        (SIZE - 4, 8, 0, "fall outside"),
        (SIZE, 1, 0, "fall outside"),
    ],
)
def test_reads_outside_the_grant_are_denied_before_any_copy(
    holder: Holder, offset: int, length: int, rkey_xor: int, match: str
) -> None:
    ch = ShmChannel(holder.descriptor())
    try:
        dst = memoryview(bytearray(b"\x00" * 16))
        good = Read(holder.region.address, holder.region.rkey, 8, 8)
        bad = Read(holder.region.address + offset, holder.region.rkey ^ rkey_xor, length, 0)
        with pytest.raises(AccessDenied, match=match):
            ch.read([good, bad], dst, 1.0)
        assert bytes(dst) == b"\x00" * 16  # the batch is checked whole, then copied
    finally:
        ch.close()


def test_a_peer_on_another_host_is_refused(holder: Holder) -> None:
    d = dict(holder.descriptor(), host_id="elsewhere/boot")
    with pytest.raises(PeerUnavailable, match="another host"):
        ShmChannel(d)


def test_a_recreated_pool_file_is_refused(holder: Holder, tmp_path: Path) -> None:
    """An agent restart that recreated the file must not be read through an old descriptor."""
    d = holder.descriptor()
    spec = json.loads(d["regions"])
    spec[0]["inode"] += 1
    with pytest.raises(PeerUnavailable, match="was recreated"):
        ShmChannel(dict(d, regions=json.dumps(spec)))
    spec[0]["path"] = str(tmp_path / "gone")
    with pytest.raises(PeerUnavailable, match="is gone"):
        ShmChannel(dict(d, regions=json.dumps(spec)))


@pytest.mark.parametrize("regions", ["not json", '[{"rkey": 1}]', "[1]"])
def test_a_malformed_descriptor_is_refused(holder: Holder, regions: str) -> None:
    with pytest.raises(PeerUnavailable, match="bad shm descriptor"):
        ShmChannel(dict(holder.descriptor(), regions=regions))


def test_the_reader_mapping_is_read_only(holder: Holder) -> None:
    ro = SharedMemory.open_readonly(holder.mem.path)
    try:
        assert ro.view().readonly
    finally:
        ro.close()


def test_only_whole_pool_mappings_can_be_registered(holder: Holder) -> None:
    with pytest.raises(ValueError, match="whole pool-file mappings"):
        holder.transport.register(holder.view[PAGE_BYTES:])
    assert holder.transport.register(holder.view) == holder.region  # idempotent


def test_closing_the_transport_revokes_the_rkey(holder: Holder) -> None:
    holder.transport.close()
    with pytest.raises(AccessDenied):
        holder.transport.registry.resolve(holder.region.address, holder.region.rkey, 8)
    assert json.loads(holder.descriptor()["regions"]) == []


# ----------------------------------------------------------- the engine


@dataclass
class Node:
    mem: SharedMemory
    view: memoryview
    engine: TransferEngine


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    nodes = []
    for name in ("a", "b"):
        mem = SharedMemory.create(str(tmp_path / f"kvdir-{name}-pool0"), SIZE)
        view = mem.view()
        view[:] = bytes([ord(name)]) * SIZE
        engine = TransferEngine(["shm"], shared=[mem])
        nodes.append(Node(mem, view, engine))
    try:
        yield nodes[0], nodes[1]
    finally:
        for n in nodes:
            n.engine.close()
            n.view.release()
            n.mem.close()


def test_engine_picks_shm_and_reads_a_peer(two_nodes: tuple[Node, Node]) -> None:
    a, b = two_nodes
    region = a.engine.register(a.view)
    assert b.engine.register(b.view).rkey != 0
    offered = [Descriptor("tcp", {"endpoint": "127.0.0.1:1"}), *a.engine.descriptors()]
    name, ch = b.engine.open_channel(offered)
    try:
        assert name == "shm"
        dst = memoryview(bytearray(64))
        assert ch.read([Read(region.address + 100, region.rkey, 64, 0)], dst, 1.0) == 64
        assert bytes(dst) == b"a" * 64
    finally:
        ch.close()


def test_engine_with_nothing_in_common_refuses(two_nodes: tuple[Node, Node]) -> None:
    _, b = two_nodes
    with pytest.raises(PeerUnavailable, match="none offered in common"):
        b.engine.open_channel([Descriptor("tcp", {"endpoint": "127.0.0.1:1"})])


def test_engine_reports_why_a_common_backend_failed(two_nodes: tuple[Node, Node]) -> None:
    a, b = two_nodes
    a.engine.register(a.view)
    (d,) = a.engine.descriptors()
    with pytest.raises(PeerUnavailable, match="shm: shm peer is on another host"):
        b.engine.open_channel([Descriptor("shm", dict(d.params, host_id="x"))])


def test_engine_configuration_errors() -> None:
    with pytest.raises(ValueError, match="unknown transfer backends: rdma9"):
        TransferEngine(["shm", "rdma9"])
    with pytest.raises(ValueError, match="needs the pools' shared memory"):
        TransferEngine(["shm"])
