"""The cuda transport on a real GPU: CUDA IPC between two processes, one kernel
per scattered batch, reader-side checks.

Skipped where there is no CuPy or no CUDA GPU (CI has neither). Run on a GPU
machine with::

    python -m pytest --noconftest -W default tests/gpu -q

(--noconftest: tests/conftest.py imports the gRPC stack, which these tests do not
need.) The committed results of a device run are in bench/results/gpu-*.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="the cuda transport needs CuPy (CI has no GPU)")
torch = pytest.importorskip("torch", reason="these tests allocate GPU memory through torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)

from kvdir.transfer.base import AccessDenied, Read  # noqa: E402
from kvdir.transfer.cuda_ipc import CudaIpcTransport, GpuBuffer  # noqa: E402
from kvdir.transfer.engine import Descriptor, TransferEngine  # noqa: E402
from kvdir.transfer.paged import PagedLayout, SegmentBatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS, BLOCKS, SEG = 4, 64, 32 << 10
PATTERN = 251  # byte at region offset o is o % 251: checkable without the holder's memory


def _patterned(nbytes: int) -> Any:
    return (torch.arange(nbytes, device="cuda", dtype=torch.int64) % PATTERN).to(torch.uint8)


READER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, torch
    from kvdir.transfer.base import AccessDenied, Read
    from kvdir.transfer.engine import Descriptor, TransferEngine
    from kvdir.transfer.paged import PagedLayout
    P = 251
    spec = json.loads(sys.stdin.read())
    eng = TransferEngine(["cuda"])
    ch = eng.open_device_channel([Descriptor("cuda", spec["descriptor"])])
    rkey, base = spec["rkey"], spec["address"]
    src_layout = ch.layout(rkey)
    dst_layout = PagedLayout.contiguous(src_layout.layers, src_layout.blocks,
                                        src_layout.segment_bytes)
    dst = torch.zeros(dst_layout.span, dtype=torch.uint8, device="cuda")
    src_blocks, dst_blocks = [5, 17, 3, 60, 61], [0, 9, 10, 2, 3]
    batch = src_layout.segments(rkey, base, src_blocks, dst_layout, dst_blocks)
    out = {}
    t0 = time.perf_counter()
    out["moved"] = ch.read_batch(batch, dst, 10.0)
    out["first_read_s"] = time.perf_counter() - t0
    ch.read_batch(batch, dst, 10.0)
    out["opens"] = eng.transports["cuda"].handles.opened
    out["open_s"] = eng.transports["cuda"].handles.open_seconds
    host = dst.cpu().numpy()
    bad = 0
    for s, d, n in zip(batch.src, batch.dst, batch.lengths):
        want = (np.arange(s - base, s - base + n) % P).astype(np.uint8)
        bad += int((host[d:d + n] != want).sum())
    untouched = np.ones(len(host), bool)
    for d, n in zip(batch.dst, batch.lengths):
        untouched[d:d + n] = False
    out["bad_bytes"] = bad
    # The paged-block kernel (addresses computed on the GPU) lands the same bytes.
    dst2 = torch.zeros_like(dst)
    out["blocks_moved"] = ch.read_blocks(rkey, src_blocks, dst2, dst_layout, dst_blocks, 10.0)
    out["blocks_equal"] = bool(torch.equal(dst, dst2))
    try:
        ch.read_blocks(rkey, [src_layout.blocks], dst2, dst_layout, [0], 10.0)
        out["block_outside"] = "read"
    except AccessDenied:
        out["block_outside"] = "denied"
    out["stray_bytes"] = int((host[untouched] != 0).sum())
    # unaligned bytes take the kernel's byte path
    small = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    ch.read_device([Read(base + 3, rkey, 1001, 5)], small, 10.0)
    got = small.cpu().numpy()[5:1006]
    out["unaligned_ok"] = bool((got == (np.arange(3, 1004) % P).astype(np.uint8)).all())
    hb = bytearray(64)
    ch.read([Read(base + 100, rkey, 64, 0)], memoryview(hb), 10.0)
    out["host_ok"] = bytes(hb) == bytes((np.arange(100, 164) % P).astype(np.uint8))
    for name, r in (("outside", Read(base + spec["length"] - 8, rkey, 16, 0)),
                    ("rkey", Read(base, rkey ^ 1, 16, 0))):
        try:
            ch.read_device([r], small, 10.0)
            out[name] = "read"
        except AccessDenied as e:
            out[name] = "denied"
    ch.close()
    print(json.dumps(out))
    """
)


def test_second_process_reads_scattered_blocks_through_ipc() -> None:
    eng = TransferEngine(["cuda"])
    layout = PagedLayout.contiguous(LAYERS, BLOCKS, SEG)
    mem = _patterned(layout.span)
    torch.cuda.synchronize()
    region = eng.register_device(mem, layout)
    assert eng.register_device(mem, layout) == region  # same buffer, same region
    spec = {
        "descriptor": eng.descriptors()[0].params,
        "rkey": region.rkey,
        "address": region.address,
        "length": region.length,
    }
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", READER],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("reader:", out)
    assert out["moved"] == 5 * 2 * LAYERS * SEG
    assert out["bad_bytes"] == 0
    assert out["blocks_moved"] == out["moved"] and out["blocks_equal"]
    assert out["block_outside"] == "denied"
    assert out["stray_bytes"] == 0
    assert out["opens"] == 1  # opened once, cached for the second read
    assert out["unaligned_ok"] and out["host_ok"]
    assert out["outside"] == "denied" and out["rkey"] == "denied"
    eng.close()


def test_same_process_channel_copies_without_ipc() -> None:
    """A process reading its own export uses the address directly (IPC cannot open it)."""
    t = CudaIpcTransport()
    src = _patterned(1 << 20)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    region = t.register_device(src)
    ch = t.connect(t.descriptor())
    batch = SegmentBatch(
        region.rkey,
        np.array([region.address + 4096, region.address], np.int64),
        np.array([0, 300 << 10], np.int64),
        np.array([200 << 10, 16], np.int64),
    )
    assert ch.read_batch(batch, dst, 5.0) == (200 << 10) + 16
    assert torch.equal(dst[: 200 << 10], src[4096 : 4096 + (200 << 10)])
    assert torch.equal(dst[300 << 10 : (300 << 10) + 16], src[:16])
    assert t.handles.opened == 0
    with pytest.raises(ValueError, match="does not fit"):
        ch.read_batch(batch, dst[:1024], 5.0)
    with pytest.raises(AccessDenied):
        ch.read_device([Read(region.address - 1, region.rkey, 2, 0)], dst, 5.0)
    ch.close()


def test_registration_refuses_what_is_not_gpu_memory() -> None:
    t = CudaIpcTransport()
    with pytest.raises(ValueError, match="GPU memory"):
        t.register(memoryview(bytearray(64)))
    with pytest.raises(TypeError, match="CPU tensor"):
        t.register_device(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        t.register_device(torch.zeros((4, 4), device="cuda").t())
    with pytest.raises(ValueError, match="layout spans"):
        t.register_device(torch.zeros(16, device="cuda"), PagedLayout.contiguous(1, 4, 64))
    a = cupy.zeros(1 << 16, dtype=cupy.uint8)  # CuPy arrays and raw pointers register too
    r = t.register_device(a)
    assert (r.address, r.length) == (a.data.ptr, a.nbytes)
    raw = GpuBuffer.at(a.data.ptr + 4096, 4096, a.device.id)
    assert t.register_device(raw).length == 4096
    offered = [Descriptor("cuda", t.descriptor())]
    assert len(json.loads(offered[0].params["regions"])) == 2
