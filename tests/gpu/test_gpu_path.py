"""The product GPU path's kernels on a real GPU: vLLM-shaped caches <-> a GPU tier.

Skipped without CuPy or a CUDA GPU (CI has neither; the device run's output
is committed under bench/results/). Run::

    python -m pytest --noconftest -W default tests/gpu -q
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

cupy = pytest.importorskip("cupy", reason="the GPU path needs CuPy (CI has no GPU)")
torch = pytest.importorskip("torch", reason="these tests allocate GPU memory through torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)

from kvdir.agent.engine.gpu_kv import GpuKvMover, GpuPathError  # noqa: E402
from kvdir.agent.gpu_pool import GpuTier  # noqa: E402
from kvdir.agent.pool import KvPool  # noqa: E402
from kvdir.transfer.cuda_blocks import BlockCopier, vllm_planes  # noqa: E402

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 40, 16, 2, 64
SLOTS = 32


def _caches() -> list[Any]:
    """vLLM's per-layer caches, each its own allocation, random bf16 contents."""
    g = torch.Generator(device="cuda").manual_seed(7)
    return [
        torch.randn((2, BLOCKS, BS, HEADS, DIM), generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


@pytest.fixture
def pool() -> Any:
    seg = BS * HEADS * DIM * 2
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        p = KvPool.open(os.path.join(d, "pool"), "gpu-test", 2 * LAYERS * seg + 4096, SLOTS)
        yield p
        p.close()


def test_save_then_load_moves_whole_blocks_and_stages_host_copies(pool: Any) -> None:
    tier = GpuTier.open(pool, 0)
    src, dst = _caches(), [torch.zeros((2, BLOCKS, BS, HEADS, DIM), dtype=torch.bfloat16,
                                       device="cuda") for _ in range(LAYERS)]  # fmt: skip
    saver = GpuKvMover(src, pool, tier.address, 0)
    loader = GpuKvMover(dst, pool, tier.address, 0)
    blocks, slots, back = [5, 17, 3, 39], [30, 2, 11, 0], [1, 38, 20, 7]
    hashes = [bytes([i + 1]) * 16 for i in range(4)]
    assert saver.save("r1", blocks, slots, hashes, after=0)
    done: list[Any] = []
    while not done:
        done = saver.finished_saves()
    assert [p.tag for p in done] == ["r1"] and saver.saves_in_flight == 0
    ev = loader.load(slots, back)
    loader.wait(ev, 10.0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[:, blocks], d[:, back])
        untouched = [b for b in range(BLOCKS) if b not in back]
        assert not d[:, untouched].any()
    # host copy of slot 30 = block 5 of every layer, layer-major, K then V
    seg = BS * HEADS * DIM * 2
    host = bytes(pool.slot_view(30)[: 2 * LAYERS * seg])
    want = b"".join(
        src[layer][kv, 5].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for layer in range(LAYERS)
        for kv in range(2)
    )
    assert host == want
    # a host copy uploaded back lands in the tier
    cupy.cuda.runtime.memset(tier.slot_address(30), 0, tier.slot_bytes)
    tier.upload([30], 10.0)
    fresh = [torch.zeros_like(dst[0]) for _ in range(LAYERS)]
    again = GpuKvMover(fresh, pool, tier.address, 0)
    again.wait(again.load([30], [0]), 10.0)
    assert all(torch.equal(f[:, 0], s[:, 5]) for f, s in zip(fresh, src, strict=True))
    tier.close()


def test_validation_after_load_stops_at_a_reused_slot(pool: Any) -> None:
    tier = GpuTier.open(pool, 0)
    caches = _caches()
    mover = GpuKvMover(caches, pool, tier.address, 0)
    got = pool.allocate(4)
    slots, gens = [s for s, _ in got], [g for _, g in got]
    hashes = [bytes([9, i]) * 8 for i in range(4)]
    for s, h, g in zip(slots, hashes, gens, strict=True):
        assert pool.mark_stored(s, h, g)
    before = mover.generations(slots)
    pool.evict(slots[2])  # reused between lookup and read: generation first
    mover.wait(mover.load(slots, [0, 1, 2, 3]), 10.0)
    assert mover.validated(slots, hashes, before) == 2
    tier.close()


def test_block_major_caches_of_vllm_024_move_whole_blocks(pool: Any) -> None:
    """vLLM 0.24's FlashAttention shapes a layer [blocks, 2, block_size, heads, dim]:
    read from the strides, saved and loaded back byte for byte."""
    tier = GpuTier.open(pool, 0)
    g = torch.Generator(device="cuda").manual_seed(11)
    src = [
        torch.randn((BLOCKS, 2, BS, HEADS, DIM), generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    dst = [torch.zeros_like(t) for t in src]
    saver = GpuKvMover(src, pool, tier.address, 0, num_blocks=BLOCKS)
    loader = GpuKvMover(dst, pool, tier.address, 0, num_blocks=BLOCKS)
    hashes = [bytes([7, i]) * 8 for i in range(3)]
    assert saver.save("r", [2, 30, 9], [4, 5, 6], hashes, after=0, hold=0)
    done: list[Any] = []
    while not done:
        done = saver.finished_saves()
    loader.wait(loader.load([4, 5, 6], [0, 1, 2]), 10.0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[[2, 30, 9]], d[[0, 1, 2]])
        assert not d[3:].any()


def test_layouts_whose_blocks_are_not_segments_are_refused(pool: Any) -> None:
    odd = torch.zeros((BLOCKS, BS, 2, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(GpuPathError):
        GpuKvMover([odd], pool, 1 << 40, 0)
    permuted = torch.zeros((2, BLOCKS, HEADS, BS, DIM), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError):  # a block's tokens are strided, not one segment
        vllm_planes([permuted.permute(0, 3, 1, 2, 4)])
    planes, seg = vllm_planes(_caches())
    with pytest.raises(ValueError, match="outside"):
        BlockCopier(0).launch(planes, [BLOCKS], planes, [0], seg)
