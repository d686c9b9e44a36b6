"""The rdma backend against a real ibverbs stack (rdma_rxe, inside the VM).

Holder and reader are two transports (two device contexts, two protection
domains) in one process, except where the holder must die: then it is a
child process (holder_proc) that the test kills.
"""

from __future__ import annotations

import json
import mmap
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import pyverbs.enums as e
from pyverbs.wr import SGE, SendWR

from kvdir.transfer.base import AccessDenied, PeerUnavailable, Read, Region
from kvdir.transfer.rdma import SEND_WR_MAX, RdmaChannel, RdmaTransport
from kvdir.transfer.rdma_support import capabilities
from tests.rdma.guest.holder_proc import pattern

MIB = 1 << 20
HOLDER_BYTES = 24 * MIB


@dataclass
class Pair:
    holder: RdmaTransport
    reader: RdmaTransport
    region: Region
    src: bytes
    dst: mmap.mmap
    dst_view: memoryview
    channel: RdmaChannel


@pytest.fixture
def pair() -> Iterator[Pair]:
    holder = RdmaTransport()
    reader = RdmaTransport(exchange=lambda _d, params: holder.accept(params))
    src_mm = mmap.mmap(-1, HOLDER_BYTES)
    src = pattern(HOLDER_BYTES, 7)
    src_mm[:] = src
    region = holder.register(memoryview(src_mm))
    dst = mmap.mmap(-1, HOLDER_BYTES)
    dst_view = memoryview(dst)
    reader.register(dst_view)
    ch = reader.connect(holder.descriptor())
    assert isinstance(ch, RdmaChannel)
    try:
        yield Pair(holder, reader, region, src, dst, dst_view, ch)
    finally:
        ch.close()
        reader.close()
        holder.close()


def test_capability_report_sees_the_device() -> None:
    caps = capabilities()
    assert caps["pyverbs"] is True
    names = [d["name"] for d in caps["devices"]]
    assert "rxe0" in names, caps
    port = caps["devices"][names.index("rxe0")]["ports"][0]
    assert port["active"] and port["link_layer"] == "ethernet"


def test_register_publishes_the_real_rkey_and_address(pair: Pair) -> None:
    h = pair.holder
    assert pair.region.length == HOLDER_BYTES
    assert h.registry.regions() == [pair.region]
    (address, length, mr) = h._mrs[0]
    assert (address, length, int(mr.rkey)) == (
        pair.region.address,
        pair.region.length,
        pair.region.rkey,
    )
    d = h.descriptor()
    assert d["gid"].startswith("0000:0000:0000:0000:0000:ffff:")  # RoCE v2, IPv4-mapped
    assert d["mtu"] == "5"  # IBV_MTU_4096 (the netdev's MTU is 4500)


def test_reads_land_byte_for_byte(pair: Pair) -> None:
    rng = random.Random(3)
    reads = []
    offs = rng.sample(range(0, HOLDER_BYTES // (64 << 10) - 1), 64)
    for i, o in enumerate(offs):  # 64 scattered 64 KiB segments
        reads.append(
            Read(pair.region.address + o * (64 << 10), pair.region.rkey, 64 << 10, i << 16)
        )
    # One 10 MiB read: past rxe's 8 MiB max message size, so it is split.
    reads.append(Read(pair.region.address + 8 * MIB, pair.region.rkey, 10 * MIB, 12 * MIB))
    moved = pair.channel.read(reads, pair.dst_view, timeout_s=60)
    assert moved == sum(r.length for r in reads)
    for r in reads:
        off = r.remote_address - pair.region.address
        assert pair.dst[r.dst_offset : r.dst_offset + r.length] == pair.src[off : off + r.length]


def test_many_small_segments_fill_the_send_queue(pair: Pair) -> None:
    """More segments than SEND_WR_MAX, none adjacent: windowing and selective signaling."""
    n = SEND_WR_MAX * 3 + 5
    reads = [
        Read(pair.region.address + i * 8192, pair.region.rkey, 4096, i * 4096) for i in range(n)
    ]
    pair.channel.read(reads, pair.dst_view, timeout_s=120)
    for i in range(n):
        assert pair.dst[i * 4096 : (i + 1) * 4096] == pair.src[i * 8192 : i * 8192 + 4096]


def test_unregistered_destinations_small_and_large(pair: Pair) -> None:
    small = bytearray(64 * 5)  # the fetcher's header scratch: goes through the bounce buffer
    reads = [Read(pair.region.address + i * 4096, pair.region.rkey, 64, i * 64) for i in range(5)]
    pair.channel.read(reads, memoryview(small), timeout_s=30)
    assert bytes(small) == b"".join(pair.src[i * 4096 : i * 4096 + 64] for i in range(5))
    big = bytearray(3 * MIB)  # larger than the bounce buffer: registered for the read
    pair.channel.read(
        [Read(pair.region.address + MIB, pair.region.rkey, 3 * MIB, 0)], memoryview(big), 30
    )
    assert bytes(big) == pair.src[MIB : 4 * MIB]


def test_wrong_rkey_is_a_clear_error_and_the_channel_recovers(pair: Pair) -> None:
    bad = (pair.region.rkey ^ 0x5A5A) or 1
    before = pair.reader.errors.snapshot().get(("completion", "IBV_WC_REM_ACCESS_ERR"), 0)
    with pytest.raises(AccessDenied, match=r"rkey 0x[0-9a-f]+.*REM_ACCESS_ERR|REM_ACCESS_ERR"):
        pair.channel.read([Read(pair.region.address, bad, 4096, 0)], pair.dst_view, 10)
    # Counted for kvdir_agent_rdma_errors_total{kind="completion",status="IBV_WC_REM_ACCESS_ERR"}.
    assert pair.reader.errors.snapshot()[("completion", "IBV_WC_REM_ACCESS_ERR")] == before + 1
    # The QP went to ERR: the next read reconnects and works.
    pair.channel.read([Read(pair.region.address, pair.region.rkey, 4096, 0)], pair.dst_view, 10)
    assert pair.dst[:4096] == pair.src[:4096]
    assert pair.channel.reconnects == 1


def test_out_of_bounds_is_a_clear_error(pair: Pair) -> None:
    end = pair.region.address + pair.region.length
    with pytest.raises(AccessDenied, match="outside the holder's registered memory"):
        pair.channel.read([Read(end - 4096, pair.region.rkey, 8192, 0)], pair.dst_view, 10)
    pair.channel.read([Read(end - 4096, pair.region.rkey, 4096, 0)], pair.dst_view, 10)
    assert pair.dst[:4096] == pair.src[-4096:]


def test_pool_memory_is_not_remotely_writable(pair: Pair) -> None:
    """The MR grants REMOTE_READ only: an RDMA WRITE into the holder's pool is refused."""
    ch = pair.channel
    assert ch._qp is not None and ch._cq is not None
    dst_address, _, dst_mr = pair.reader._mrs[0]
    wr = SendWR(
        wr_id=1,
        opcode=e.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[SGE(dst_address, 4096, dst_mr.lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(pair.region.rkey, pair.region.address)
    ch._qp.post_send(wr)
    end = time.monotonic() + 10
    wcs: list[object] = []
    while not wcs and time.monotonic() < end:
        _, wcs = ch._cq.poll(1)
    # rxe refuses at the responder QP (no REMOTE_WRITE in its access flags:
    # REM_INV_REQ_ERR) before the MR (REM_ACCESS_ERR); neither may ever be granted.
    assert wcs, "an RDMA WRITE into the holder's pool got no completion"
    status = wcs[0].status  # type: ignore[attr-defined]
    assert status in (e.IBV_WC_REM_INV_REQ_ERR, e.IBV_WC_REM_ACCESS_ERR), status
    ch._abort(0)
    # The holder's bytes are untouched, and the channel reconnects for the next read.
    ch.read([Read(pair.region.address, pair.region.rkey, 4096, 0)], pair.dst_view, 10)
    assert pair.dst[:4096] == pair.src[:4096]


def test_dead_peer_hits_the_deadline_and_flushes() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.rdma.guest.holder_proc", str(4 * MIB), "11"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        hello = json.loads(holder.stdout.readline())
        address, length, rkey = hello["region"]

        def exchange(_d: dict[str, str], params: dict[str, str]) -> dict[str, str]:
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(json.dumps(params) + "\n")
            holder.stdin.flush()
            return dict(json.loads(holder.stdout.readline()))

        reader = RdmaTransport(exchange=exchange)
        dst = mmap.mmap(-1, 4 * MIB)
        view = memoryview(dst)
        reader.register(view)
        ch = reader.connect(hello["descriptor"])
        ch.read([Read(address, rkey, length, 0)], view, timeout_s=60)
        assert dst[:] == pattern(4 * MIB, 11)  # across processes, byte for byte
        holder.kill()
        holder.wait(10)
        t0 = time.monotonic()
        assert reader.errors.total("deadline") + reader.errors.total("completion") == 0
        with pytest.raises(PeerUnavailable, match=r"deadline|does not answer"):
            ch.read([Read(address, rkey, length, 0)], view, timeout_s=2.0)
        took = time.monotonic() - t0
        assert took < 2.0 + 5.0, took  # the deadline, plus a bounded flush
        # rxe never completes (a deadline flush); real NICs may report RETRY_EXC first.
        assert reader.errors.total("deadline") + reader.errors.total("completion") == 1
        ch.close()
        reader.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        holder.stdin.close()
        holder.stdout.close()
