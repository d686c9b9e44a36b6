"""Whole KV blocks between any two block-addressed GPU layouts: one kernel per batch.

A layout is a `PlaneSet`: a KV block is `planes` segments of `segment_bytes`
(for vLLM, plane 2l is layer l's keys and 2l+1 its values), and segment p of
block b lives at ``pointers[p] + b * block_stride``. That covers every layout
the GPU path meets, with no assumption that planes share an allocation:

- vLLM's per-layer caches (``[num_blocks, 2, block_size, heads, head_dim]``
  in vLLM 0.24's FlashAttention, ``[2, num_blocks, ...]`` in older ones, the
  token dims in either physical order), each layer its own allocation:
  pointers = (K, V) of every layer, block_stride from the strides
  (`vllm_planes`, transfer/kv_layout.py);
- the agent's GPU tier and the host pool: slot-major, slot s holds every
  plane of one block back to back (`slot_planes`), block_stride = slot_bytes;
- one contiguous slot per block (planes = 1, segment = the whole slot), for
  staging a tier's slots to host memory.

`BlockCopier.launch` uploads one parameter buffer (a header, the plane
pointers of both sides, the source and destination block ids) with one
async copy and launches one kernel with one thread block per (plane, block)
segment, on the stream it is given; it returns an event recorded after the
kernel. Host work is independent of the layer count beyond 16 bytes a plane,
and no copy is issued per segment (docs/gpu.md).

Ordering is the caller's: the kernel starts after what is already queued on
`stream`, and whoever needs the bytes waits on the returned event (or makes
their stream wait on it). The parameter buffers stay referenced until that
event completed, so a launch never waits on the previous one.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvdir.transfer.base import TransferError
from kvdir.transfer.cuda_ipc import COPY_KERNEL_SOURCE, THREADS, cuda_errors, load_cupy
from kvdir.transfer.kv_layout import cache_layout

Ids = npt.NDArray[np.int64]

BLOCKS_PER_COPY_MAX = 1 << 20
"""One launch moves at most this many blocks (bounded parameter buffers)."""
PLANES_MAX = 4096
"""Planes of one layout (2 x layers; 4,096 = 2,048 layers)."""
IN_FLIGHT_MAX = 64
"""Launches whose parameter buffers one copier keeps alive before it waits."""
_HEADER = 8
"""int64 slots ahead of the plane pointers in the parameter buffer."""
_HOST_TO_DEVICE = 1

_SOURCE = (
    COPY_KERNEL_SOURCE
    + r"""
// p = [n, planes, segment bytes, src block stride, dst block stride, 3 x pad,
//      src plane pointers (planes), dst plane pointers (planes), src ids (n), dst ids (n)]
extern "C" __global__ void kvdir_copy_planes(const long long* __restrict__ p) {
    const long long n = p[0], planes = p[1], seg = p[2];
    const long long id = blockIdx.x;
    if (id >= planes * n) return;
    const long long plane = id / n, i = id - plane * n;
    const long long* sp = p + 8;
    const long long* dp = sp + planes;
    const long long* ids = dp + planes;
    kvdir_copy((unsigned long long)(sp[plane] + ids[i] * p[3]),
               (unsigned long long)(dp[plane] + ids[n + i] * p[4]),
               (unsigned long long)seg);
}
"""
)


@dataclass(frozen=True, slots=True)
class PlaneSet:
    """Where every segment of every block is: pointers[p] + block * block_stride.

    `blocks` bounds the block ids a copy may name (checked before launch).
    """

    pointers: tuple[int, ...]
    block_stride: int
    blocks: int

    def __post_init__(self) -> None:
        if not 0 < len(self.pointers) <= PLANES_MAX:
            raise ValueError(f"a layout needs 1..{PLANES_MAX} planes, got {len(self.pointers)}")
        if self.block_stride <= 0 or self.blocks <= 0 or min(self.pointers) <= 0:
            raise ValueError("planes need pointers, a positive block stride and blocks")

    @property
    def planes(self) -> int:
        return len(self.pointers)


def slot_planes(
    base: int, slots: int, slot_bytes: int, planes: int, segment_bytes: int
) -> PlaneSet:
    """A slot-major pool at `base`: plane p of slot s at base + s*slot_bytes + p*segment."""
    if planes * segment_bytes > slot_bytes:
        raise ValueError(f"{planes} planes of {segment_bytes} B do not fit a {slot_bytes} B slot")
    return PlaneSet(tuple(base + p * segment_bytes for p in range(planes)), slot_bytes, slots)


def vllm_planes(layers: Sequence[Any], num_blocks: int | None = None) -> tuple[PlaneSet, int]:
    """(planes, segment bytes) of vLLM's per-layer caches, from their real strides.

    Plane 2l is layer l's keys, 2l+1 its values. Every layer must have the
    same shape, strides and dtype; where a block's keys and values sit is read
    from the strides (transfer/kv_layout.py), so a backend's physical order is
    followed, never assumed, and a cache whose blocks are not whole segments
    is refused. `num_blocks` (vLLM's count) tells the block dim from the K/V
    dim; by default the larger of dims 0 and 1.
    """
    if not layers:
        raise ValueError("no KV cache layers")
    first = layers[0]
    shape, strides, dtype = tuple(first.shape), tuple(first.stride()), first.dtype
    if len(shape) != 5:
        raise ValueError(f"want per-layer caches of 5 dims, got {shape}")
    blocks = num_blocks if num_blocks is not None else max(shape[0], shape[1])
    layout = cache_layout(shape, strides, blocks)
    item = first.element_size()
    pointers: list[int] = []
    for t in layers:
        if tuple(t.shape) != shape or tuple(t.stride()) != strides or t.dtype != dtype:
            raise ValueError("every layer must have one shape, stride order and dtype")
        if not t.is_cuda:
            raise ValueError("the KV caches are not CUDA tensors")
        base = int(t.data_ptr())
        pointers += [base, base + layout.kv_stride * item]
    planes = PlaneSet(tuple(pointers), layout.block_stride * item, blocks)
    return planes, layout.segment_elems * item


def external_stream(cp: Any, stream: int) -> Any:
    """CuPy's handle of a raw cudaStream_t made elsewhere (torch's, or 0: legacy default).

    CuPy 14 deprecates ExternalStream for objects implementing the CUDA stream
    protocol; a bare handle has no such object, so the warning is not ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(stream)


def _ids(x: Sequence[int] | Ids, limit: int, what: str) -> Ids:
    a = np.asarray(x, dtype=np.int64)
    if len(a) and (int(a.min()) < 0 or int(a.max()) >= limit):
        raise ValueError(f"a {what} block id is outside 0..{limit - 1}")
    return a


class BlockCopier:
    """Launches block copies on one device; thread-safe."""

    def __init__(self, device: int) -> None:
        self.cp = load_cupy()
        self.device = device
        with self.cp.cuda.Device(device):
            self._kernel = self.cp.RawKernel(_SOURCE, "kvdir_copy_planes")
            self._kernel.compile()
        self._lock = threading.Lock()
        self._in_flight: list[tuple[Any, Any, Any]] = []
        self.launches = 0

    def event(self, stream: int) -> Any:
        """A fresh event recorded now on `stream` (a raw cudaStream_t; 0 = legacy default)."""
        cp = self.cp
        with cp.cuda.Device(self.device):
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(external_stream(cp, stream))
        return ev

    def launch(
        self,
        src: PlaneSet,
        src_ids: Sequence[int] | Ids,
        dst: PlaneSet,
        dst_ids: Sequence[int] | Ids,
        segment_bytes: int,
        stream: int = 0,
    ) -> Any:
        """Copy blocks src_ids[i] -> dst_ids[i] (every plane) on `stream`; returns an
        event recorded after the kernel, or None when there is nothing to copy."""
        s, d = _ids(src_ids, src.blocks, "source"), _ids(dst_ids, dst.blocks, "destination")
        n, planes = len(s), src.planes
        if len(d) != n or dst.planes != planes:
            raise ValueError(f"{n} -> {len(d)} blocks, {planes} -> {dst.planes} planes")
        if n > BLOCKS_PER_COPY_MAX or segment_bytes <= 0:
            raise ValueError(f"{n} blocks (limit {BLOCKS_PER_COPY_MAX}), segment {segment_bytes}")
        if n == 0:
            return None
        if segment_bytes > min(src.block_stride, dst.block_stride) and planes > 1:
            raise ValueError("segments overlap the next block (segment > block stride)")
        cp = self.cp
        count = _HEADER + 2 * planes + 2 * n
        with self._lock, cp.cuda.Device(self.device):
            self._reap()
            pinned = cp.cuda.alloc_pinned_memory(8 * count)
            host = np.frombuffer(pinned, np.int64, count)
            host[:5] = (n, planes, segment_bytes, src.block_stride, dst.block_stride)
            host[_HEADER : _HEADER + planes] = src.pointers
            host[_HEADER + planes : _HEADER + 2 * planes] = dst.pointers
            host[_HEADER + 2 * planes : _HEADER + 2 * planes + n] = s
            host[_HEADER + 2 * planes + n :] = d
            st = external_stream(cp, stream)
            try:
                with st:
                    params = cp.empty(count, dtype=np.int64)
                    cp.cuda.runtime.memcpyAsync(
                        params.data.ptr, host.ctypes.data, 8 * count, _HOST_TO_DEVICE, st.ptr
                    )
                    self._kernel((n * planes,), (THREADS,), (params,))
                    done = cp.cuda.Event(disable_timing=True)
                    done.record(st)
            except cuda_errors(cp) as e:
                raise TransferError(f"block copy failed to launch: {e}") from e
            self._in_flight.append((done, pinned, params))
            self.launches += 1
        return done

    def _reap(self) -> None:
        """Drop buffers of launches that completed; wait for the oldest beyond the bound."""
        self._in_flight = [f for f in self._in_flight if not f[0].done]
        while len(self._in_flight) >= IN_FLIGHT_MAX:
            self._in_flight.pop(0)[0].synchronize()
