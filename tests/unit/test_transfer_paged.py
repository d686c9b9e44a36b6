"""Paged KV layouts and segment batches (pure numpy; the GPU side is tests/gpu)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.transfer.base import PeerUnavailable, Read
from kvdir.transfer.cuda_ipc import CudaIpcChannel
from kvdir.transfer.paged import PagedLayout, SegmentBatch


def _apply(batch: SegmentBatch, src: np.ndarray, src_base: int, dst: np.ndarray) -> None:
    for s, d, n in zip(batch.src, batch.dst, batch.lengths, strict=True):
        dst[d : d + n] = src[s - src_base : s - src_base + n]


def test_segments_move_whole_blocks_between_vllm_layouts() -> None:
    """Copy through the segment arrays == copy of the blocks in a [L, 2, B, seg] view."""
    layers, seg = 3, 48
    src_l = PagedLayout.contiguous(layers, 10, seg)
    # The destination allocates layers separately (vLLM): strides with gaps, and an offset.
    dst_l = PagedLayout(layers, 7, seg, layer_stride=7 * 2 * seg + 96, kv_stride=7 * seg + 16,
                        offset=32)  # fmt: skip
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, src_l.span, dtype=np.uint8)
    dst = np.zeros(dst_l.span, dtype=np.uint8)
    base = 1 << 40
    src_blocks, dst_blocks = [9, 0, 4], [2, 6, 0]
    batch = src_l.segments(77, base, src_blocks, dst_l, dst_blocks)
    assert len(batch) == 3 * 2 * layers and batch.rkey == 77
    assert batch.nbytes == 3 * src_l.block_bytes
    _apply(batch, src, base, dst)
    sv = src.reshape(layers, 2, 10, seg)
    for layer in range(layers):
        for kv in range(2):
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                o = dst_l.offset + layer * dst_l.layer_stride + kv * dst_l.kv_stride + d * seg
                assert (dst[o : o + seg] == sv[layer, kv, s]).all()
    assert src_l.block_address(base, 4) == base + 4 * seg


def test_segments_refuse_mismatched_or_outside_blocks() -> None:
    a = PagedLayout.contiguous(2, 4, 64)
    with pytest.raises(ValueError, match="source block"):
        a.segments(1, 0, [4], a, [0])
    with pytest.raises(ValueError, match="destination block"):
        a.segments(1, 0, [0], a, [-1])
    with pytest.raises(ValueError, match="layouts differ"):
        a.segments(1, 0, [0], PagedLayout.contiguous(3, 4, 64), [0])
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        a.segments(1, 0, [0, 1], a, [0])
    with pytest.raises(ValueError, match="kv_stride"):
        PagedLayout(2, 4, 64, layer_stride=1024, kv_stride=100)


def test_layout_descriptor_round_trip_and_bad_input() -> None:
    a = PagedLayout(32, 1024, 32768, 2 * 1024 * 32768 + 4096, 1024 * 32768, 8192)
    assert PagedLayout.from_json(a.to_json()) == a
    with pytest.raises(ValueError, match="bad paged layout"):
        PagedLayout.from_json('{"layers": 2}')
    with pytest.raises(ValueError, match="bad paged layout"):
        PagedLayout.from_json("not json")


def test_consecutive_blocks_coalesce_into_one_run_per_plane() -> None:
    a = PagedLayout.contiguous(4, 16, 1024)
    batch = a.segments(1, 0, range(3, 11), a, range(0, 8)).coalesce()
    assert len(batch) == 4 * 2 and set(batch.lengths.tolist()) == {8 * 1024}
    pieces = batch.split(3000)
    assert int(pieces.lengths.max()) <= 3000 and pieces.nbytes == batch.nbytes


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 9)), min_size=1, max_size=12),
    st.integers(1, 7),
)
def test_coalesce_and_split_copy_the_same_bytes(segs: list[tuple[int, int]], piece: int) -> None:
    # Non-overlapping destinations (a read never writes one byte twice).
    dst_off, reads = 0, []
    for s, n in segs:
        reads.append(Read(100 + s, 5, n, dst_off))
        dst_off += n + (s % 3)
    batch = SegmentBatch.of_reads(reads)
    src = np.arange(200, dtype=np.uint8)
    want = np.zeros(dst_off, np.uint8)
    _apply(batch, src, 0, want)
    for b in (batch.coalesce(), batch.split(piece), batch.coalesce().split(piece)):
        got = np.zeros(dst_off, np.uint8)
        _apply(b, src, 0, got)
        assert (got == want).all()
        assert b.nbytes == batch.nbytes
    assert len(batch.coalesce()) <= len(batch)
    assert int(batch.split(piece).lengths.max()) <= piece


def test_batch_refuses_bad_segments() -> None:
    with pytest.raises(ValueError, match="one region"):
        SegmentBatch.of_reads([Read(0, 1, 8, 0), Read(8, 2, 8, 8)])
    with pytest.raises(ValueError, match="positive lengths"):
        SegmentBatch(1, np.array([0]), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="differ in length"):
        SegmentBatch(1, np.array([0, 1]), np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match="piece_bytes"):
        SegmentBatch.of_reads([Read(0, 1, 8, 0)]).split(0)


def test_cuda_channel_refuses_a_peer_on_another_host() -> None:
    """Checked before any CUDA call, so it runs without a GPU."""
    with pytest.raises(PeerUnavailable, match="another host"):
        CudaIpcChannel(
            {"host_id": "elsewhere/boot", "pid": "1", "regions": "[]"}, None, cast(Any, None)
        )


def test_engine_without_cupy_says_what_is_missing() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: the missing-CuPy message cannot be seen")
    from kvdir.transfer.engine import TransferEngine

    with pytest.raises(ValueError, match="CuPy"):
        TransferEngine(["cuda"])
