"""Worker side: moving blocks between vLLM's per-layer KV caches and pool slots.

vLLM hands connectors one logical ``[B, H, N, C]`` view per layer (dim 0 is
the block; strides follow the backend's physical layout). A pool slot holds
one block of every layer, layer l's [H, N, C] part at l x layer_block_bytes,
row-major. A move goes run by run where pool slots and vLLM blocks are both
consecutive (one copy per run and layer, straight from source to destination:
the save reserve hands out slots together and vLLM allocates a request's blocks
together); a scattered move is one gather and one scatter per layer for the
whole batch (index_select / index_copy_), never a loop over blocks. When
every layer's blocks are contiguous rows and the pool's layer parts are 8-byte
aligned, both sides are viewed as rows of int64 words: torch then moves 8
bytes per element instead of 2 (a 16 MiB load: ~40% less time on one core).
CUDA engines use kvcopy_cuda.py instead (one kernel for every layer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvdir.agent.engine.vllm.namespace import KvShape, NamespaceError, dtype_name
from kvdir.agent.pool import KvPool

log = logging.getLogger("kvdir.vllm")


def shape_of(kv_caches: dict[str, torch.Tensor], device: str) -> KvShape:
    """The KvShape of registered caches (every layer must look alike)."""
    if not kv_caches:
        raise NamespaceError("kvdir connector: vLLM registered no KV caches")
    layers = list(kv_caches.values())
    first = layers[0]
    for name, t in kv_caches.items():
        if t.dim() < 2 or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise NamespaceError(
                f"kvdir connector: layer {name} has KV shape {tuple(t.shape)} {t.dtype}, "
                f"unlike {tuple(first.shape)} {first.dtype} (hybrid models are not supported)"
            )
    if len({t.data_ptr() for t in layers}) != len(layers):
        raise NamespaceError("kvdir connector: layers share KV caches (not supported)")
    return KvShape(
        layers=len(layers),
        block_shape=tuple(int(d) for d in first.shape[1:]),
        dtype=dtype_name(first.dtype),
        itemsize=first.element_size(),
        device=device,
    )


class BlockCopier:
    """Gathers and scatters blocks between the KV caches and one mapped pool."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], shape: KvShape, pool: KvPool) -> None:
        g = pool.geometry
        if g.slot_bytes < shape.block_bytes:
            raise NamespaceError(
                f"kvdir connector: pool slots of {g.slot_bytes} B hold no block of "
                f"{shape.block_bytes} B"
            )
        self.layers = list(kv_caches.values())
        self.shape = shape
        data = pool.view[g.data_offset : g.data_offset + g.slots * g.slot_bytes]
        self._keep = data  # the tensor below borrows this buffer
        slots = torch.frombuffer(data, dtype=torch.uint8).view(g.slots, g.slot_bytes)
        lb = shape.layer_block_bytes
        self.pool_layers = [slots[:, i * lb : (i + 1) * lb] for i in range(shape.layers)]
        self._rows = _word_rows(self.layers, self.pool_layers)
        """(vLLM layers, pool layers) as int64 rows, one per block, or None (see above)."""
        first = self.layers[0]
        log.info(
            "kvdir CPU mover: %s (a layer's cache %s, strides %s)",
            "blocks as int64 rows" if self._rows is not None else "element-wise",
            tuple(first.shape),
            tuple(first.stride()),
        )
        self._ready: list[tuple[tuple[bytes, ...], tuple[int, ...]]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=device)

    def to_pool(
        self, block_ids: Sequence[int], slots: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        """Save: vLLM blocks -> pool slots, synchronously (announce via `completed`)."""
        if not block_ids:
            return True
        self._copy_out(block_ids, slots)
        self._done((tuple(hashes), tuple(slots)))
        return True

    def fetched(self, slots: Sequence[int], hashes: Sequence[bytes], transport: str) -> None:
        """Blocks a fetch wrote into the pool's host slots: ready to announce."""
        self._done((tuple(hashes), tuple(slots)))

    def _done(self, item: tuple[tuple[bytes, ...], tuple[int, ...]]) -> None:
        with self._lock:
            self._ready.append(item)

    def completed(self) -> list[tuple[tuple[bytes, ...], tuple[int, ...]]]:
        """(hashes, slots) written since the last call: announce them stored."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    @property
    def in_flight(self) -> int:
        return 0

    def close(self) -> None:
        return

    def _copy_out(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        n = len(block_ids)
        if self._rows is not None and _by_runs(self._rows[0], self._rows[1], block_ids, slots):
            return
        si = self._index(slots, torch.device("cpu"))
        bi = self._index(block_ids, self.layers[0].device)
        if self._rows is not None:
            for kv_rows, pool_rows in zip(*self._rows, strict=True):
                pool_rows.index_copy_(0, si, kv_rows.index_select(0, bi))
            return
        for kv, dst in zip(self.layers, self.pool_layers, strict=True):
            src = kv.index_select(0, bi).cpu()  # contiguous [n, H, N, C]
            dst.index_copy_(0, si, src.view(torch.uint8).reshape(n, -1))

    def from_pool(self, slots: Sequence[int], block_ids: Sequence[int], stream: int = 0) -> None:
        """Load: pool slots -> vLLM blocks (`stream`: unused on CPU)."""
        if not block_ids:
            return
        n = len(block_ids)
        if self._rows is not None and _by_runs(self._rows[1], self._rows[0], slots, block_ids):
            return
        si = self._index(slots, torch.device("cpu"))
        bi = self._index(block_ids, self.layers[0].device)
        if self._rows is not None:
            for kv_rows, pool_rows in zip(*self._rows, strict=True):
                kv_rows.index_copy_(0, bi, pool_rows.index_select(0, si))
            return
        for kv, src in zip(self.layers, self.pool_layers, strict=True):
            part = src.index_select(0, si).view(kv.dtype).view(n, *kv.shape[1:])
            kv.index_copy_(0, bi, part.to(kv.device))


RUNS_PER_BLOCK_MAX = 0.5
"""Copy run by run (one memcpy per run and layer, no gathered temporary) while there
are at most this many runs per block; more scattered moves go through index_select
and index_copy_ (two passes, but two calls per layer)."""


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the stretches where both index lists go up
    by one at a time, in order: pool slots the reserve handed out together and the
    blocks vLLM allocated together are mostly such stretches."""
    a = np.asarray(src, np.int64)
    b = np.asarray(dst, np.int64)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} sources for {len(b)} destinations")
    if not len(a):
        return []
    cut = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.r_[0, cut]
    lengths = np.diff(np.r_[starts, len(a)])
    return list(zip(a[starts].tolist(), b[starts].tolist(), lengths.tolist(), strict=True))


def _by_runs(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
) -> bool:
    """Rows `src_ids` of every layer of `src` into rows `dst_ids` of `dst`, run by run;
    False (nothing moved) when the ids are too scattered for runs to pay."""
    runs = paired_runs(src_ids, dst_ids)
    if len(runs) > len(src_ids) * RUNS_PER_BLOCK_MAX:
        return False
    for s_rows, d_rows in zip(src, dst, strict=True):
        for a, b, k in runs:
            d_rows[b : b + k].copy_(s_rows[a : a + k])
    return True


def _word_rows(
    layers: Sequence[torch.Tensor], pool_layers: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Every layer's cache and the pool's layer parts as [blocks, words] int64 views,
    or None when one cannot be viewed so without a copy (a block not one contiguous
    row, a size or an offset not a multiple of 8 bytes, a cache not on the CPU)."""
    kv_rows, pool_rows = [], []
    try:
        for kv, part in zip(layers, pool_layers, strict=True):
            if kv.device.type != "cpu":
                return None
            rows = kv.view(torch.uint8).view(kv.shape[0], -1)  # raises unless rows are whole
            if rows.stride(1) != 1 or rows.shape[1] != part.shape[1]:
                return None
            kv_rows.append(rows.view(torch.int64))
            pool_rows.append(part.view(torch.int64))
    except RuntimeError:
        return None
    return kv_rows, pool_rows
