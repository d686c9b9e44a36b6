"""Paged KV layouts and segment batches: from "these blocks" to arrays of copies.

A GPU KV cache in vLLM's layout is, per layer, one tensor
``[2, blocks, block_size, kv_heads, head_dim]``: block b's keys of layer l are
one contiguous segment, its values another, so one block is ``2 x layers``
segments scattered over the cache. `PagedLayout` describes such a cache as
byte offsets inside one registered region (the holder publishes it with the
region, see docs/gpu.md), and `PagedLayout.segments` turns "copy my blocks
[..] into your blocks [..]" into a `SegmentBatch`: three numpy arrays
(source offset, destination offset, length), built without a Python loop per
segment. 4,000 tokens of the 8B shape are 16,000 segments, and a per-segment
Python object alone would cost more than the copy.

`SegmentBatch.coalesce` merges runs that are adjacent on both sides and
`SegmentBatch.split` bounds every piece (a copy kernel gives each piece one
thread block, so a 1 GiB run must not become one piece).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvdir.transfer.base import Read

Offsets = npt.NDArray[np.int64]

SEGMENTS_MAX = 1 << 24
"""One batch never describes more copies than this (16 Mi x 24 B of arrays)."""


@dataclass(frozen=True, slots=True)
class SegmentBatch:
    """Copies of `lengths[i]` bytes from source offset `src[i]` to destination `dst[i]`.

    Source offsets are remote addresses (as published) under one `rkey`;
    destination offsets are relative to the reader's destination buffer.
    """

    rkey: int
    src: Offsets
    dst: Offsets
    lengths: Offsets

    def __post_init__(self) -> None:
        n = len(self.src)
        if len(self.dst) != n or len(self.lengths) != n:
            raise ValueError("segment arrays differ in length")
        if n > SEGMENTS_MAX:
            raise ValueError(f"{n} segments in one batch (limit {SEGMENTS_MAX})")
        if n and (int(self.lengths.min()) <= 0 or int(self.dst.min()) < 0):
            raise ValueError("segments need positive lengths and non-negative offsets")

    def __len__(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def of_reads(cls, reads: Sequence[Read]) -> SegmentBatch:
        """The batch of a list of `Read`s (all under one rkey)."""
        rkeys = {r.rkey for r in reads}
        if len(rkeys) > 1:
            raise ValueError("a segment batch reads one region (one rkey)")
        return cls(
            rkeys.pop() if rkeys else 0,
            np.fromiter((r.remote_address for r in reads), np.int64, len(reads)),
            np.fromiter((r.dst_offset for r in reads), np.int64, len(reads)),
            np.fromiter((r.length for r in reads), np.int64, len(reads)),
        )

    def coalesce(self) -> SegmentBatch:
        """Merge segments adjacent both at the source and at the destination."""
        if len(self) < 2:
            return self
        order = np.argsort(self.src, kind="stable")
        src, dst, ln = self.src[order], self.dst[order], self.lengths[order]
        joins = (src[:-1] + ln[:-1] == src[1:]) & (dst[:-1] + ln[:-1] == dst[1:])
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return SegmentBatch(self.rkey, src[starts], dst[starts], np.add.reduceat(ln, starts))

    def split(self, piece_bytes: int) -> SegmentBatch:
        """Cut every segment into pieces of at most `piece_bytes`."""
        if piece_bytes <= 0:
            raise ValueError("piece_bytes must be > 0")
        if len(self) == 0 or int(self.lengths.max()) <= piece_bytes:
            return self
        pieces = -(-self.lengths // piece_bytes)
        seg = np.repeat(np.arange(len(self)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = (np.arange(len(seg)) - first) * piece_bytes
        lengths = np.minimum(self.lengths[seg] - k, piece_bytes)
        return SegmentBatch(self.rkey, self.src[seg] + k, self.dst[seg] + k, lengths)


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """A paged KV cache inside one region: ``layers`` x [2, blocks, segment_bytes].

    ``offset`` is where layer 0 starts inside the region; ``layer_stride`` and
    ``kv_stride`` are in bytes (vLLM allocates each layer separately; a region
    holding all layers in one allocation has layer_stride = 2 x blocks x
    segment_bytes).
    """

    layers: int
    blocks: int
    segment_bytes: int
    layer_stride: int
    kv_stride: int
    offset: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.blocks, self.segment_bytes) <= 0:
            raise ValueError("layers, blocks and segment_bytes must be > 0")
        if self.kv_stride < self.blocks * self.segment_bytes:
            raise ValueError("kv_stride is smaller than one plane of blocks")
        if (
            self.layers > 1
            and self.layer_stride < self.kv_stride + self.blocks * self.segment_bytes
        ):
            raise ValueError("layer_stride is smaller than one layer")
        if self.offset < 0:
            raise ValueError("offset must be >= 0")

    @classmethod
    def contiguous(cls, layers: int, blocks: int, segment_bytes: int) -> PagedLayout:
        """All layers in one allocation: [layers, 2, blocks, segment_bytes]."""
        plane = blocks * segment_bytes
        return cls(layers, blocks, segment_bytes, 2 * plane, plane)

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block over every layer (keys and values)."""
        return 2 * self.layers * self.segment_bytes

    @property
    def span(self) -> int:
        """Bytes from the region start to the end of the last segment."""
        return (
            self.offset
            + (self.layers - 1) * self.layer_stride
            + self.kv_stride
            + (self.blocks * self.segment_bytes)
        )

    def block_address(self, base: int, block: int) -> int:
        """The address published for `block` (its layer-0 key segment)."""
        return base + self.offset + block * self.segment_bytes

    def _plane_offsets(self) -> Offsets:
        layer = np.arange(self.layers, dtype=np.int64) * self.layer_stride
        kv = np.array([0, self.kv_stride], dtype=np.int64)
        return (self.offset + layer[:, None] + kv[None, :]).reshape(-1)

    def _check(self, blocks: npt.NDArray[np.int64], what: str) -> None:
        if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= self.blocks):
            raise ValueError(f"{what} block outside 0..{self.blocks - 1}")

    def segments(
        self,
        rkey: int,
        src_base: int,
        src_blocks: Sequence[int] | npt.NDArray[np.int64],
        dst: PagedLayout,
        dst_blocks: Sequence[int] | npt.NDArray[np.int64],
    ) -> SegmentBatch:
        """Copies of blocks `src_blocks` (this layout, region at `src_base`) into
        blocks `dst_blocks` of `dst` (offsets relative to the destination buffer)."""
        s = np.asarray(src_blocks, dtype=np.int64)
        d = np.asarray(dst_blocks, dtype=np.int64)
        if len(s) != len(d):
            raise ValueError(f"{len(s)} source blocks but {len(d)} destination blocks")
        if (self.layers, self.segment_bytes) != (dst.layers, dst.segment_bytes):
            raise ValueError(
                f"layouts differ: {self.layers} layers x {self.segment_bytes} B segments "
                f"vs {dst.layers} x {dst.segment_bytes}"
            )
        self._check(s, "source")
        dst._check(d, "destination")
        n = len(s) * 2 * self.layers
        src_off = src_base + self._plane_offsets()[:, None] + s[None, :] * self.segment_bytes
        dst_off = dst._plane_offsets()[:, None] + d[None, :] * dst.segment_bytes
        return SegmentBatch(
            rkey,
            src_off.reshape(-1),
            dst_off.reshape(-1),
            np.full(n, self.segment_bytes, dtype=np.int64),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "layers": self.layers,
                "blocks": self.blocks,
                "segment_bytes": self.segment_bytes,
                "layer_stride": self.layer_stride,
                "kv_stride": self.kv_stride,
                "offset": self.offset,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PagedLayout:
        try:
            d = json.loads(text)
            return cls(
                int(d["layers"]),
                int(d["blocks"]),
                int(d["segment_bytes"]),
                int(d["layer_stride"]),
                int(d["kv_stride"]),
                int(d.get("offset", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad paged layout: {e}") from e
