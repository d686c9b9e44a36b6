"""Where each block of a vLLM per-layer KV cache lives, read from the tensor's own strides.

vLLM's attention backends shape a layer's cache logically as either
``(2, num_blocks, block_size, heads, head_dim)`` (older FlashAttention) or
``(num_blocks, 2, block_size, heads, head_dim)`` (vLLM 0.24's FlashAttention,
FlashInfer, Triton), and each backend may permute the physical order of the
last three dims (``get_kv_cache_stride_order``: NHD or HND). None of that is
assumed here: the block dim and the key/value dim are found by their sizes,
and the three token dims must form one physically contiguous run of memory
(whatever their order), so that one block of one plane (keys or values of
one layer) is one segment a copy kernel can move whole. A cache that does
not have that property is refused, never copied wrong.

The physical order is named with one letter per dim, outermost first:
B block, K key/value, N token in block, H head, C channel. It goes into the
kvdir namespace, so two engines whose bytes mean different things never
share a block. Pure: shapes and strides in, a `CacheLayout` out (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

TOKEN_DIMS = "NHC"
"""The logical order of the last three dims in every backend vLLM ships."""


class LayoutError(ValueError):
    """The cache's memory layout is not one whose blocks are whole segments (says why)."""


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Element offsets of block b, plane k: b * block_stride + k * kv_stride."""

    block_stride: int
    kv_stride: int
    segment_elems: int
    order: str
    """Physical order, outermost first, e.g. "BKNHC" (vLLM 0.24 FlashAttention, NHD)."""
    token_shape: tuple[int, int, int]
    """(block_size, heads, head_dim): the logical sizes of N, H and C."""


def cache_layout(shape: Sequence[int], strides: Sequence[int], num_blocks: int) -> CacheLayout:
    """The layout of one layer's cache of `num_blocks` blocks (sizes and strides in elements)."""
    if len(shape) != 5 or len(strides) != 5:
        raise LayoutError(f"want a 5-dim per-layer KV cache, got shape {tuple(shape)}")
    lead = [d for d in (0, 1) if shape[d] == num_blocks]
    kv_lead = [d for d in (0, 1) if shape[d] == 2]
    if num_blocks == 2 or len(lead) != 1 or len(kv_lead) != 1 or lead == kv_lead:
        raise LayoutError(
            f"cannot tell the block dim from the key/value dim in shape {tuple(shape)} "
            f"with {num_blocks} blocks"
        )
    b, k = lead[0], kv_lead[0]
    seg = prod(shape[2:])
    inner = sorted(range(2, 5), key=lambda d: (strides[d], d))
    expect = 1
    for d in inner:
        if shape[d] != 1 and strides[d] != expect:
            raise LayoutError(
                f"a block's tokens are not one contiguous segment (shape {tuple(shape)}, "
                f"strides {tuple(strides)})"
            )
        expect *= shape[d]
    bs, ks = strides[b], strides[k]
    block_outer = ks >= seg and bs >= 2 * ks
    kv_outer = bs >= seg and ks >= num_blocks * bs
    if not (block_outer or kv_outer):
        raise LayoutError(f"keys, values and blocks overlap (strides {tuple(strides)})")
    outer = "BK" if block_outer else "KB"
    order = outer + "".join(TOKEN_DIMS[d - 2] for d in reversed(inner))
    return CacheLayout(bs, ks, seg, order, (shape[2], shape[3], shape[4]))


def predicted_order(kv_cache_layout: str) -> str:
    """The physical order vLLM 0.24's CUDA backends give a per-layer cache for
    its ``kv_cache_layout`` setting ("NHD" or "HND"): what the scheduler side,
    which never sees the tensors, puts in the namespace. The worker checks the
    real tensors against it (`cache_layout`) and refuses a mismatch."""
    if kv_cache_layout == "NHD":
        return "BKNHC"
    if kv_cache_layout == "HND":
        return "BKHNC"
    raise LayoutError(f"unknown vLLM KV cache layout {kv_cache_layout!r} (NHD or HND)")
