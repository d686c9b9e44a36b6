"""transfer/kv_layout.py: where vLLM's blocks are, read from real strides (no torch needed)."""

from __future__ import annotations

from math import prod

import pytest

from kvdir.transfer.kv_layout import LayoutError, cache_layout, predicted_order


def _strides(shape: tuple[int, ...], physical: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor of logical `shape` stored in the dim order `physical`
    (outermost first), as torch's permute of a contiguous tensor gives them."""
    out = [0] * len(shape)
    step = 1
    for d in reversed(physical):
        out[d] = step
        step *= shape[d]
    return tuple(out)


BLOCKS, BS, H, C = 100, 16, 8, 128


def test_vllm_024_flash_attention_nhd_is_block_major() -> None:
    shape = (BLOCKS, 2, BS, H, C)
    got = cache_layout(shape, _strides(shape, (0, 1, 2, 3, 4)), BLOCKS)
    assert got.order == "BKNHC" and got.segment_elems == BS * H * C
    assert got.block_stride == 2 * BS * H * C and got.kv_stride == BS * H * C
    assert got.token_shape == (BS, H, C)


def test_hnd_permutes_the_token_dims_and_stays_one_segment() -> None:
    shape = (BLOCKS, 2, BS, H, C)
    got = cache_layout(shape, _strides(shape, (0, 1, 3, 2, 4)), BLOCKS)
    assert got.order == "BKHNC" and got.segment_elems == BS * H * C


def test_older_kv_major_caches_are_read_too() -> None:
    shape = (2, BLOCKS, BS, H, C)
    got = cache_layout(shape, _strides(shape, (0, 1, 2, 3, 4)), BLOCKS)
    assert got.order == "KBNHC" and got.kv_stride == BLOCKS * BS * H * C
    assert got.block_stride == BS * H * C


def test_caches_whose_blocks_are_not_segments_are_refused() -> None:
    shape = (BLOCKS, 2, BS, H, C)
    # the key/value dim innermost but one: a block's keys are strided, not one run
    with pytest.raises(LayoutError, match="contiguous"):
        cache_layout(shape, _strides(shape, (0, 2, 3, 1, 4)), BLOCKS)
    # blocks interleaved inside a token row: refused, never copied wrong
    with pytest.raises(LayoutError):
        cache_layout(shape, _strides(shape, (2, 0, 1, 3, 4)), BLOCKS)


def test_ambiguous_or_malformed_shapes_are_refused() -> None:
    shape = (2, 2, BS, H, C)
    with pytest.raises(LayoutError, match="block dim"):
        cache_layout(shape, _strides(shape, (0, 1, 2, 3, 4)), 2)
    with pytest.raises(LayoutError, match="5-dim"):
        cache_layout((BLOCKS, BS, H, C), (BS * H * C, H * C, C, 1), BLOCKS)
    shape = (BLOCKS, 2, BS, H, C)
    with pytest.raises(LayoutError, match="block dim"):
        cache_layout(shape, _strides(shape, (0, 1, 2, 3, 4)), BLOCKS + 1)


def test_the_scheduler_predicts_the_order_the_worker_checks() -> None:
    shape = (BLOCKS, 2, BS, H, C)
    nhd = cache_layout(shape, _strides(shape, (0, 1, 2, 3, 4)), BLOCKS)
    hnd = cache_layout(shape, _strides(shape, (0, 1, 3, 2, 4)), BLOCKS)
    assert predicted_order("NHD") == nhd.order and predicted_order("HND") == hnd.order
    with pytest.raises(LayoutError):
        predicted_order("XYZ")
    assert prod(nhd.token_shape) == nhd.segment_elems
