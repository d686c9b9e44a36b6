"""The `cuda` backend: same-host reads of a peer's GPU memory through CUDA IPC.

The GPU analogue of the shm backend. A holder registers GPU memory (a torch
CUDA tensor, a CuPy array, anything with ``__cuda_array_interface__``, or a
raw device pointer via `GpuBuffer.at`); `descriptor` publishes, per region,
the CUDA IPC handle of the allocation that holds it (`cudaIpcGetMemHandle`,
64 bytes: the capability that plays the rkey's role), the region's offset in
that allocation, its address, length and rkey, and optionally its paged KV
layout. A reader on the same host opens the handle once
(`cudaIpcOpenMemHandle`, ~0.65 ms on an H200, so opened handles are cached
per process and shared by every channel) and then copies straight from the
holder's GPU memory into its own: the holder's CPU and GPU stream take no
part.

Scattered segments move in ONE kernel launch per batch: the reader turns the
batch into a table of (source pointer, destination pointer, length) pieces,
uploads it, and a copy kernel gives each piece one thread block (16-byte
loads where aligned). No copy is issued per segment.

Ordering and validation (see docs/gpu.md): the kernel runs on the legacy
default stream of the destination device, so it starts after work already
queued there by the reading process (a torch engine on its default stream),
and `read_batch` returns only once the copy completed. The backend moves
bytes; it does not know whether the holder still holds them. As with every
one-sided backend, the caller validates after the copy: it reads the holder's
slot headers (generations) *after* `read_batch` returned and trusts a block
only if its generation is unchanged. That is sound because a holder bumps a
slot's generation before it queues any GPU work that rewrites the slot.

Neither torch nor CuPy is imported at module import time beyond what this
module needs: it imports CuPy (kernels, IPC, memcpy) when a transport is
created, and touches torch only through the objects it is handed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdir.transfer.base import (
    AccessDenied,
    Channel,
    CopyTimedOut,
    PeerUnavailable,
    Read,
    Region,
    TransferError,
    Transport,
    check_destination,
    coalesce,
)
from kvdir.transfer.memory import buffer_address
from kvdir.transfer.paged import PagedLayout, SegmentBatch
from kvdir.transfer.shm import host_identity

PIECE_BYTES = 64 << 10
"""Largest piece one thread block copies (bigger segments are split)."""
THREADS = 256
SPIN_S = 0.002
OPEN_HANDLES_MAX = 1024
"""Bound on IPC mappings one process keeps open (each maps a whole allocation)."""
IPC_HANDLE_BYTES = 64
_PARAMS = 16
"""int64 slots ahead of the block ids in kvdir_copy_blocks' parameter buffer."""
BLOCKS_PER_READ_MAX = 1 << 20
"""One read_blocks call moves at most this many blocks (bounded id buffers)."""
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_MEMCPY_DEVICE_TO_DEVICE = 3

_KERNEL = r"""
struct __align__(16) kvdir_v16 { unsigned long long lo, hi; };

__device__ __forceinline__ void kvdir_copy(unsigned long long s, unsigned long long d,
                                           unsigned long long len) {
    const unsigned long long step = blockDim.x;
    if (((s | d | len) & 15ULL) == 0) {
        const kvdir_v16* __restrict__ src = reinterpret_cast<const kvdir_v16*>(s);
        kvdir_v16* __restrict__ dst = reinterpret_cast<kvdir_v16*>(d);
        const unsigned long long words = len >> 4;
        unsigned long long k = threadIdx.x;
        for (; k + 3 * step < words; k += 4 * step) {
            const kvdir_v16 a = src[k], b = src[k + step], c = src[k + 2 * step],
                            e = src[k + 3 * step];
            dst[k] = a; dst[k + step] = b; dst[k + 2 * step] = c; dst[k + 3 * step] = e;
        }
        for (; k < words; k += step) dst[k] = src[k];
    } else {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(s);
        unsigned char* dst = reinterpret_cast<unsigned char*>(d);
        for (unsigned long long k = threadIdx.x; k < len; k += step) dst[k] = src[k];
    }
}

// One thread block per piece: table = [src pointers | dst pointers | lengths].
extern "C" __global__ void kvdir_copy_segments(const unsigned long long* __restrict__ table,
                                               const long long n) {
    const long long i = blockIdx.x;
    if (i >= n) return;
    kvdir_copy(table[i], table[n + i], table[2 * n + i]);
}

// One thread block per (layer, K/V, block) segment of a paged KV cache; the
// addresses are computed here from the block ids, so the host uploads 16 bytes per
// block instead of 24 per segment. p = [src base, dst base, n, planes, segment bytes,
// src layer stride, src K/V stride, dst layer stride, dst K/V stride, 7 x pad,
// n src blocks, n dst blocks]: one upload, one kernel argument (argument handling
// in the host's launch call costs more than the 128-byte header read per block).
extern "C" __global__ void kvdir_copy_blocks(const long long* __restrict__ p) {
    const long long n = p[2], planes = p[3], seg = p[4];
    const long long id = blockIdx.x;
    if (id >= planes * n) return;
    const long long plane = id / n, i = id - plane * n;
    const long long layer = plane >> 1, kv = plane & 1;
    const long long* blocks = p + 16;
    kvdir_copy((unsigned long long)p[0] + layer * p[5] + kv * p[6] + blocks[i] * seg,
               (unsigned long long)p[1] + layer * p[7] + kv * p[8] + blocks[n + i] * seg,
               (unsigned long long)seg);
}
"""
COPY_KERNEL_SOURCE = _KERNEL
"""The copy device function and kernels, for modules that add kernels of their own."""


class CudaUnavailable(ValueError):
    """No usable CUDA here (CuPy missing, or no GPU)."""


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailable(
            f"the cuda backend needs CuPy ({e}); install the cupy-cudaXXx wheel "
            "that matches the CUDA driver, or drop 'cuda' from transports"
        ) from e
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise CudaUnavailable("the cuda backend found no GPU")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise CudaUnavailable(f"the cuda backend found no usable GPU: {e}") from e
    return cupy


def cuda_errors(cp: Any) -> tuple[type[BaseException], ...]:
    """CuPy's exceptions for failed CUDA runtime and driver calls (kernel launches)."""
    return (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError)


_libcuda: ctypes.CDLL | None = None


def _allocation_of(address: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding `address` (cuMemGetAddressRange)."""
    global _libcuda  # noqa: PLW0603 - one handle to the driver per process
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)
    )
    if rc != 0:
        raise ValueError(f"{address:#x} is not device memory of this process (CUDA error {rc})")
    return base.value, size.value


@dataclass(frozen=True, slots=True)
class GpuBuffer:
    """A span of device memory: pointer, byte length, device ordinal.

    `owner` keeps the tensor or array it came from alive while registered.
    """

    address: int
    nbytes: int
    device: int
    owner: object = field(default=None, compare=False, repr=False)

    @classmethod
    def at(cls, address: int, nbytes: int, device: int) -> GpuBuffer:
        """A raw device pointer (the caller keeps the memory alive)."""
        if address <= 0 or nbytes <= 0 or device < 0:
            raise ValueError("a GPU buffer needs a pointer, a positive length and a device")
        return cls(address, nbytes, device)

    @classmethod
    def of(cls, obj: object) -> GpuBuffer:
        """A contiguous torch CUDA tensor, CuPy array, or ``__cuda_array_interface__``."""
        if isinstance(obj, GpuBuffer):
            return obj
        if hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda"):  # torch, any dtype
            t: Any = obj
            if not t.is_cuda:
                raise TypeError("a CPU tensor is not GPU memory")
            if not t.is_contiguous():
                raise ValueError("register a contiguous tensor (its storage is one span)")
            return cls(int(t.data_ptr()), int(t.numel() * t.element_size()), int(t.device.index), t)
        iface = getattr(obj, "__cuda_array_interface__", None)
        if not isinstance(iface, dict):
            raise TypeError(
                f"{type(obj).__name__} is not GPU memory: pass a torch CUDA tensor, a CuPy "
                "array, an object with __cuda_array_interface__, or GpuBuffer.at(pointer, ...)"
            )
        shape = tuple(int(s) for s in iface["shape"])
        itemsize = int(str(iface["typestr"])[2:])
        strides = iface.get("strides")
        if strides is not None:
            want, acc = [], itemsize
            for s in reversed(shape):
                want.append(acc)
                acc *= s
            if tuple(strides) != tuple(reversed(want)):
                raise ValueError("register a C-contiguous array (its memory is one span)")
        address = int(iface["data"][0])
        device = int(_cupy().cuda.runtime.pointerGetAttributes(address).device)
        return cls(address, math.prod(shape) * itemsize, device, obj)


@dataclass(frozen=True, slots=True)
class _Remote:
    region: Region
    handle: bytes
    handle_offset: int
    pid: int
    layout: PagedLayout | None


class _HandleCache:
    """Opened IPC handles of this process: (handle, device) -> (pointer, users).

    Opening costs ~0.65 ms and one process may open a handle only once per
    device, so every channel shares these and the last user closes them.
    """

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self._lock = threading.Lock()
        self._open: dict[tuple[bytes, int], list[int]] = {}
        self.opened = 0
        self.open_seconds = 0.0

    def acquire(self, handle: bytes, device: int) -> int:
        key = (handle, device)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            if len(self._open) >= OPEN_HANDLES_MAX:
                raise TransferError(f"{OPEN_HANDLES_MAX} CUDA IPC handles open in this process")
            t0 = time.perf_counter()
            try:
                with self._cp.cuda.Device(device):
                    ptr = int(self._cp.cuda.runtime.ipcOpenMemHandle(handle))
            except cuda_errors(self._cp) as e:
                raise PeerUnavailable(f"cannot open the peer's CUDA IPC handle: {e}") from e
            self.open_seconds += time.perf_counter() - t0
            self.opened += 1
            self._open[key] = [ptr, 1]
            return ptr

    def release(self, handle: bytes, device: int) -> None:
        key = (handle, device)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._open[key]
        with (
            contextlib.suppress(self._cp.cuda.runtime.CUDARuntimeError),
            self._cp.cuda.Device(device),
        ):
            self._cp.cuda.runtime.ipcCloseMemHandle(entry[0])


_kernels: dict[tuple[int, str], Any] = {}
_kernels_lock = threading.Lock()


def _kernel(cp: Any, device: int, name: str = "kvdir_copy_segments") -> Any:
    with _kernels_lock:
        k = _kernels.get((device, name))
        if k is None:
            with cp.cuda.Device(device):
                k = cp.RawKernel(_KERNEL, name)
                if hasattr(k, "compile"):
                    k.compile()  # now, not inside the first timed read
            _kernels[(device, name)] = k
        return k


def copy_pieces(cp: Any, device: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Any:
    """Launch one copy of every piece (absolute device pointers) on `device`'s
    legacy default stream; returns an event recorded after it."""
    n = len(src)
    table = np.empty(3 * n, dtype=np.uint64)
    table[:n], table[n : 2 * n], table[2 * n :] = src, dst, lengths
    with cp.cuda.Device(device):
        stream = cp.cuda.Stream.null
        with stream:
            dev_table = cp.asarray(table)
            _kernel(cp, device)((n,), (THREADS,), (dev_table, np.int64(n)))
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        # The table must outlive the kernel: cupy's pool reuses freed blocks in
        # stream order, so dropping the reference after the launch is safe.
        del dev_table
    return done


def _wait(event: Any, deadline: float, what: str) -> None:
    """Until `event` completed: spin for the first SPIN_S (a read of a few hundred
    MB lands in well under a millisecond, and yielding adds its latency to every
    read), then yield the CPU between queries."""
    now = time.perf_counter()
    spin_until = now + SPIN_S
    while not event.done:
        now = time.perf_counter()
        if now > deadline:
            raise CopyTimedOut(f"{what} did not complete in time")
        if now > spin_until:
            time.sleep(0)


@dataclass(slots=True)
class _Staging:
    """Per channel and device: pinned and device buffers for block ids, an event."""

    host: np.ndarray
    pinned: Any
    device: Any
    done: Any
    kernel: Any


class CudaIpcChannel(Channel):
    """Reads of one same-host peer's registered GPU regions."""

    def __init__(self, descriptor: dict[str, str], cp: Any, handles: _HandleCache) -> None:
        if descriptor.get("host_id") != host_identity():
            raise PeerUnavailable("cuda peer is on another host (CUDA IPC is same-host only)")
        self._cp = cp
        self._handles = handles
        self._lock = threading.Lock()
        self._held: set[tuple[bytes, int]] = set()
        self._remotes: dict[int, _Remote] = {}
        self._staging: dict[int, _Staging] = {}
        self._retired: list[_Staging] = []
        self.profile = False
        """Diagnostics: when set, read_blocks records `last_host_s` (call entry to
        launch returned) and `last_kernel_s` (CUDA events around the kernel alone)."""
        self.last_host_s = 0.0
        self.last_kernel_s = 0.0
        try:
            pid = int(descriptor["pid"])
            for spec in json.loads(descriptor["regions"]):
                handle = bytes.fromhex(str(spec["handle"]))
                if len(handle) != IPC_HANDLE_BYTES:
                    raise ValueError(f"IPC handle of {len(handle)} bytes")
                layout = spec.get("layout")
                region = Region(int(spec["address"]), int(spec["length"]), int(spec["rkey"]))
                self._remotes[region.rkey] = _Remote(
                    region,
                    handle,
                    int(spec["handle_offset"]),
                    pid,
                    PagedLayout.from_json(json.dumps(layout)) if layout else None,
                )
        except (KeyError, ValueError, TypeError) as e:
            raise PeerUnavailable(f"bad cuda descriptor: {e}") from e

    def layout(self, rkey: int) -> PagedLayout | None:
        """The paged KV layout the holder published with region `rkey`, if any."""
        r = self._remotes.get(rkey)
        return None if r is None else r.layout

    def region(self, rkey: int) -> Region:
        r = self._remotes.get(rkey)
        if r is None:
            raise AccessDenied(f"rkey {rkey:#x} was never granted")
        return r.region

    def device_pointer(self, rkey: int, device: int) -> int:
        """Where region `rkey` starts in this process, mapped for `device` (opens once)."""
        r = self._remotes.get(rkey)
        if r is None:
            raise AccessDenied(f"rkey {rkey:#x} was never granted")
        if r.pid == os.getpid():
            return r.region.address  # our own export: IPC cannot (and need not) open it
        key = (r.handle, device)
        with self._lock:
            held = key in self._held
        ptr = self._handles.acquire(r.handle, device)
        if held:
            self._handles.release(r.handle, device)  # one reference per channel
        else:
            with self._lock:
                self._held.add(key)
        return ptr + r.handle_offset

    def _checked(self, batch: SegmentBatch) -> _Remote:
        r = self._remotes.get(batch.rkey)
        if r is None:
            raise AccessDenied(f"rkey {batch.rkey:#x} was never granted")
        if len(batch) and (
            int(batch.src.min()) < r.region.address
            or int((batch.src + batch.lengths).max()) > r.region.address + r.region.length
        ):
            raise AccessDenied(f"a segment falls outside the region of rkey {batch.rkey:#x}")
        return r

    def read_batch(self, batch: SegmentBatch, dst: object, timeout_s: float) -> int:
        """Copy every segment of `batch` into GPU memory `dst` (offsets relative to
        it); one kernel launch. Returns bytes moved once they landed."""
        deadline = time.perf_counter() + timeout_s
        out = GpuBuffer.of(dst)
        r = self._checked(batch)
        if len(batch) == 0:
            return 0
        if int((batch.dst + batch.lengths).max()) > out.nbytes:
            raise ValueError(f"a segment does not fit the {out.nbytes}-byte destination")
        pieces = batch.coalesce().split(PIECE_BYTES)
        base = self.device_pointer(batch.rkey, out.device)
        src = (pieces.src - r.region.address + base).astype(np.uint64)
        dst_abs = (pieces.dst + out.address).astype(np.uint64)
        try:
            done = copy_pieces(self._cp, out.device, src, dst_abs, pieces.lengths)
            _wait(done, deadline, "cuda read")
        except cuda_errors(self._cp) as e:
            raise TransferError(f"cuda read failed: {e}") from e
        return batch.nbytes

    def read_blocks(
        self,
        rkey: int,
        src_blocks: Sequence[int] | np.ndarray,
        dst: GpuBuffer | object,
        dst_layout: PagedLayout,
        dst_blocks: Sequence[int] | np.ndarray,
        timeout_s: float,
    ) -> int:
        """Copy whole KV blocks of the holder's paged region `rkey` (its published
        layout) into blocks of `dst` (laid out as `dst_layout`): one kernel that
        computes every segment's address itself. Returns bytes moved once landed.

        For the least host work per call pass int64 numpy arrays and a `GpuBuffer`
        made once (a fetch of 512 blocks is ~0.5 ms of copying; list conversion and
        tensor introspection would add a measurable share)."""
        deadline = time.perf_counter() + timeout_s
        r = self._remotes.get(rkey)
        if r is None:
            raise AccessDenied(f"rkey {rkey:#x} was never granted")
        src_l = r.layout
        if src_l is None:
            raise ValueError(f"region {rkey:#x} was published without a paged layout")
        if src_l.span > r.region.length:
            raise AccessDenied(f"the published layout overruns region {rkey:#x}")
        out = GpuBuffer.of(dst)
        if dst_layout.span > out.nbytes:
            raise ValueError(f"the layout spans {dst_layout.span} bytes, dst {out.nbytes}")
        s = np.asarray(src_blocks, dtype=np.int64)
        d = np.asarray(dst_blocks, dtype=np.int64)
        if (src_l.layers, src_l.segment_bytes) != (dst_layout.layers, dst_layout.segment_bytes):
            raise ValueError(
                f"layouts differ: {src_l.layers} layers x {src_l.segment_bytes} B segments "
                f"vs {dst_layout.layers} x {dst_layout.segment_bytes}"
            )
        if len(s) != len(d):
            raise ValueError(f"{len(s)} source blocks but {len(d)} destination blocks")
        n = len(s)
        if n == 0:
            return 0
        if n > BLOCKS_PER_READ_MAX:
            raise ValueError(f"{n} blocks in one read (limit {BLOCKS_PER_READ_MAX})")
        if int(s.min()) < 0 or int(s.max()) >= src_l.blocks:
            raise AccessDenied(f"a source block is outside region {rkey:#x}'s layout")
        if int(d.min()) < 0 or int(d.max()) >= dst_layout.blocks:
            raise ValueError(f"destination block outside 0..{dst_layout.blocks - 1}")
        base = self.device_pointer(rkey, out.device) + src_l.offset
        cp, planes = self._cp, 2 * src_l.layers
        # Host work here is what a small read costs beyond the copy itself (~0.25 ms
        # with a fresh device array, a synchronous upload and a new event per read):
        # the block ids go through a per-channel pinned buffer and one async upload,
        # and the event is reused. The channel lock keeps the buffer ours until the
        # kernel finished.
        with self._lock:
            try:
                if cp.cuda.runtime.getDevice() != out.device:
                    cp.cuda.runtime.setDevice(out.device)
                st = self._staging_for(out.device, _PARAMS + 2 * n)
                h = st.host
                h[:9] = (
                    base,
                    out.address + dst_layout.offset,
                    n,
                    planes,
                    src_l.segment_bytes,
                    src_l.layer_stride,
                    src_l.kv_stride,
                    dst_layout.layer_stride,
                    dst_layout.kv_stride,
                )
                h[_PARAMS : _PARAMS + n] = s
                h[_PARAMS + n : _PARAMS + 2 * n] = d
                cp.cuda.runtime.memcpyAsync(
                    st.device.data.ptr,
                    h.ctypes.data,
                    8 * (_PARAMS + 2 * n),
                    _MEMCPY_HOST_TO_DEVICE,
                    0,
                )
                if self.profile:
                    k0, k1 = cp.cuda.Event(), cp.cuda.Event()
                    k0.record(cp.cuda.Stream.null)
                st.kernel((n * planes,), (THREADS,), (st.device,))
                if self.profile:
                    k1.record(cp.cuda.Stream.null)
                    self.last_host_s = time.perf_counter() - (deadline - timeout_s)
                st.done.record(cp.cuda.Stream.null)
                try:
                    _wait(st.done, deadline, "cuda read")
                except TransferError:
                    # The kernel may still read these ids: never reuse the buffers.
                    del self._staging[out.device]
                    self._retired = [*self._retired[-7:], st]
                    raise
                if self.profile:
                    self.last_kernel_s = cp.cuda.get_elapsed_time(k0, k1) / 1e3
            except cuda_errors(cp) as e:
                raise TransferError(f"cuda read failed: {e}") from e
        return n * src_l.block_bytes

    def _staging_for(self, device: int, count: int) -> _Staging:
        """This channel's block-id buffers on `device` (grown to `count` ids)."""
        st = self._staging.get(device)
        if st is None or len(st.host) < count:
            cp = self._cp
            cap = max(count, 4096)
            pinned = cp.cuda.alloc_pinned_memory(cap * 8)
            st = _Staging(
                np.frombuffer(pinned, np.int64, cap),
                pinned,
                cp.empty(cap, dtype=np.int64),
                cp.cuda.Event(disable_timing=True),
                _kernel(cp, device, "kvdir_copy_blocks"),
            )
            self._staging[device] = st
        return st

    def read_device(self, reads: Sequence[Read], dst: object, timeout_s: float) -> int:
        """`Read`s into GPU memory `dst` (one launch per rkey)."""
        by_key: dict[int, list[Read]] = {}
        for rd in reads:
            by_key.setdefault(rd.rkey, []).append(rd)
        deadline = time.perf_counter() + timeout_s
        moved = 0
        for group in by_key.values():
            moved += self.read_batch(
                SegmentBatch.of_reads(group), dst, max(0.001, deadline - time.perf_counter())
            )
        return moved

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        """Into host memory: one device-to-host copy per coalesced segment. For small
        reads (tests, diagnostics); KV goes GPU to GPU through `read_batch`."""
        check_destination(reads, len(dst))
        deadline = time.perf_counter() + timeout_s
        host = buffer_address(dst)
        device = self._cp.cuda.runtime.getDevice()
        moved = 0
        for rd in coalesce(reads):
            r = self._checked(
                SegmentBatch(
                    rd.rkey,
                    np.array([rd.remote_address], np.int64),
                    np.array([0], np.int64),
                    np.array([rd.length], np.int64),
                )
            )
            src = self.device_pointer(rd.rkey, device) + rd.remote_address - r.region.address
            if time.perf_counter() > deadline:
                raise TransferError("cuda read did not complete in time")
            try:
                self._cp.cuda.runtime.memcpy(
                    host + rd.dst_offset, src, rd.length, _MEMCPY_DEVICE_TO_HOST
                )
            except cuda_errors(self._cp) as e:
                raise TransferError(f"cuda read failed: {e}") from e
            moved += rd.length
        return moved

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, set()
        for handle, device in held:
            self._handles.release(handle, device)


@dataclass(slots=True)
class _Exported:
    region: Region
    buffer: GpuBuffer
    handle: bytes
    handle_offset: int
    layout: PagedLayout | None


class CudaIpcTransport(Transport):
    """Exposes registered GPU memory to same-host peers through CUDA IPC handles."""

    name = "cuda"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.cp = _cupy()
        self._rng = rng or random.SystemRandom()
        self._lock = threading.Lock()
        self._exported: dict[int, _Exported] = {}
        self.handles = _HandleCache(self.cp)

    def register(self, memory: memoryview) -> Region:
        raise ValueError("the cuda backend exposes GPU memory: use register_device")

    def register_device(
        self, memory: object, layout: PagedLayout | None = None, rkey: int | None = None
    ) -> Region:
        """Grant same-host peers reads of GPU memory `memory` (optionally with the
        paged KV layout it holds, published with it). Same buffer again: same region."""
        buf = GpuBuffer.of(memory)
        if layout is not None and layout.span > buf.nbytes:
            raise ValueError(f"the layout spans {layout.span} bytes, the buffer {buf.nbytes}")
        with self._lock:
            for e in self._exported.values():
                if (e.buffer.address, e.buffer.nbytes) == (buf.address, buf.nbytes):
                    return e.region
        cp = self.cp
        with cp.cuda.Device(buf.device):
            cp.cuda.runtime.memGetInfo()  # makes the device's primary context current
            base, size = _allocation_of(buf.address)
            if buf.address + buf.nbytes > base + size:
                raise ValueError("the buffer runs past the end of its allocation")
            try:
                handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise ValueError(
                    f"cannot export this allocation through CUDA IPC ({e}); allocations "
                    "made through cuMemCreate (e.g. PyTorch's expandable_segments) need "
                    "the VMM/fabric path instead"
                ) from e
        with self._lock:
            if rkey is None:
                rkey = 0
                while rkey == 0 or rkey in self._exported:
                    rkey = self._rng.getrandbits(32)
            elif rkey in self._exported:
                raise ValueError(f"rkey {rkey:#x} is already registered")
            region = Region(buf.address, buf.nbytes, rkey)
            self._exported[rkey] = _Exported(region, buf, handle, buf.address - base, layout)
        return region

    def deregister(self, rkey: int) -> None:
        with self._lock:
            self._exported.pop(rkey, None)

    def regions(self) -> list[Region]:
        with self._lock:
            return [e.region for e in self._exported.values()]

    def descriptor(self) -> dict[str, str]:
        with self._lock:
            exported = list(self._exported.values())
        regions = [
            {
                "address": e.region.address,
                "length": e.region.length,
                "rkey": e.region.rkey,
                "handle": e.handle.hex(),
                "handle_offset": e.handle_offset,
                "device": e.buffer.device,
                "layout": json.loads(e.layout.to_json()) if e.layout else None,
            }
            for e in exported
        ]
        return {
            "transport": self.name,
            "regions": json.dumps(regions),
            "host_id": host_identity(),
            "pid": str(os.getpid()),
        }

    def connect(self, descriptor: dict[str, str]) -> CudaIpcChannel:
        return CudaIpcChannel(descriptor, self.cp, self.handles)

    def close(self) -> None:
        with self._lock:
            self._exported.clear()


def bare_copy(cp: Any, device: int, dst: int, src: int, nbytes: int) -> None:
    """One cudaMemcpy device-to-device (the baseline a batched read is compared with)."""
    with cp.cuda.Device(device):
        cp.cuda.runtime.memcpy(dst, src, nbytes, _MEMCPY_DEVICE_TO_DEVICE)


load_cupy = _cupy
"""CuPy, or CudaUnavailable saying why not (for the GPU modules built on this one)."""
wait_event = _wait
"""Until a CUDA event completed, or CopyTimedOut at the deadline (spin, then yield)."""
