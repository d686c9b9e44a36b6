"""The agent-owned GPU tier: a pool's slots in device memory, headers in the host file.

A namespace configured with ``tier = "gpu"`` keeps its KV in one device
allocation of the agent (`GpuTier`): slot s is ``slot_bytes`` at
``address + s * slot_bytes``, exported to same-host processes through CUDA
IPC (the `cuda` transport, its own rkey). Everything else about the slot
stays in the pool file (agent/pool.py), unchanged:

- header s (generation, state, hash) is the truth readers validate against,
  in host memory, so the engine, the agent and same-host peers read it
  without touching the GPU;
- data slot s is the block's host copy, written by the engine's save path
  before the block is marked STORED; tcp, shm and rdma serve it to readers
  that cannot map the GPU (other hosts). The pool mapping is page-locked
  (cudaHostRegister) so host copies move by DMA or by the copy kernel.

Why agent-owned slots rather than the engine's own paged blocks: a one-sided
reader must never get a block that was freed and rewritten after its lookup,
which needs the generation bumped before anything can rewrite the block. The
agent and the engine library control every rewrite of these slots (allocate,
free, evict bump first, as for host pools); vLLM reuses its own blocks inside
its scheduler with no hook that runs before the worker overwrites them
(docs/gpu.md, "Why not vLLM's own blocks"). The price is one device-to-device
copy per saved block, on a side stream.

The directory publishes a GPU pool's block at its GPU address under the GPU
rkey (tier GPU); a reader maps that back to slot s and from there to header s
and host copy s (`slot_of`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdir.agent.pool import KvPool
from kvdir.transfer.base import TransferError
from kvdir.transfer.cuda_blocks import PLANES_MAX, BlockCopier, slot_planes
from kvdir.transfer.cuda_ipc import GpuBuffer, cuda_errors, load_cupy, wait_event

log = logging.getLogger("kvdir.agent.gpu")

HOST_REGISTER_PORTABLE_MAPPED = 3
"""cudaHostRegisterPortable | cudaHostRegisterMapped: usable by every context,
and addressable by kernels (the copy kernel reads and writes host copies)."""


_HOST_TO_DEVICE = 1


class GpuTierError(ValueError):
    """The GPU tier cannot be set up here (no CUDA, not enough device memory)."""


def slot_of(gpu_address: int, slot_bytes: int, slots: int, address: int) -> int:
    """The slot a published GPU address names, or -1 when it names none."""
    return int(slots_of(gpu_address, slot_bytes, slots, np.asarray([address], np.uint64))[0])


def slots_of(base: int, slot_bytes: int, slots: int, addresses: np.ndarray) -> np.ndarray:
    """`slot_of` of many published addresses at once (u64 in, int64 out, -1 where an
    address is below `base`, off the slot grid or past the last slot)."""
    if slot_bytes <= 0:
        return np.full(len(addresses), -1, np.int64)
    a = addresses.astype(np.uint64, copy=False)
    b, sb = np.uint64(base), np.uint64(slot_bytes)
    off = a - b  # wraps below the base: refused by `a >= b`
    slot = off // sb
    ok = (a >= b) & (off % sb == 0) & (slot < np.uint64(slots))
    return np.where(ok, slot.astype(np.int64), -1)


def slot_runs(slots: Sequence[int] | np.ndarray, count: int) -> list[tuple[int, int]]:
    """`slots` as runs [a, b) of consecutive slot numbers, ascending, each once (one
    copy per run where source and destination share the slot grid); ValueError for a
    slot outside 0..count-1."""
    ids = np.unique(np.asarray(slots, np.int64))
    if not len(ids):
        return []
    if int(ids[0]) < 0 or int(ids[-1]) >= count:
        raise ValueError(f"a slot is outside 0..{count - 1}")
    cut = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.r_[0, cut]].tolist()
    ends = (ids[np.r_[cut - 1, len(ids) - 1]] + 1).tolist()
    return list(zip(starts, ends, strict=True))


PIECE_BYTES_MAX = 64 << 10
"""A slot-to-slot copy gives each piece of at most this many bytes one thread block."""


def slot_pieces(slot_bytes: int) -> tuple[int, int]:
    """(pieces, bytes each) for copying a whole slot: the fewest equal pieces of at
    most PIECE_BYTES_MAX that are whole 16-byte words (the kernel's wide loads), or
    the slot as one piece when none divides it."""
    first = -(-slot_bytes // PIECE_BYTES_MAX)
    for pieces in range(first, min(slot_bytes // 16, PLANES_MAX) + 1):
        size, rest = divmod(slot_bytes, pieces)
        if rest == 0 and size % 16 == 0:
            return pieces, size
    return 1, slot_bytes


@dataclass
class GpuTier:
    """One pool's device slots (owned by the agent) and its page-locked host file."""

    device: int
    address: int
    slot_bytes: int
    slots: int
    memory: Any
    """The CuPy allocation (a plain cudaMalloc: CUDA IPC cannot export pool chunks)."""
    pinned_host: bool
    """The pool mapping is page-locked (kernels may address the host copies)."""
    host_data: int
    """Address of data slot 0 (the host copies) in the agent's pool mapping."""
    _copier: Any = field(default=None, repr=False)
    unpin: int = 0
    """The mapping this tier page-locked (0: none, or someone else did)."""

    @classmethod
    def open(cls, pool: KvPool, device: int) -> GpuTier:
        """Allocate `pool`'s slots on `device` (zeroed) and page-lock its mapping."""
        try:
            cp = load_cupy()
        except ValueError as e:
            raise GpuTierError(str(e)) from e
        g = pool.geometry
        nbytes = g.slots * g.slot_bytes
        try:
            with cp.cuda.Device(device):
                memory = cp.cuda.Memory(nbytes)
                cp.cuda.runtime.memset(memory.ptr, 0, nbytes)
        except (*cuda_errors(cp), cp.cuda.memory.OutOfMemoryError) as e:
            raise GpuTierError(f"cannot allocate {nbytes} B on GPU {device}: {e}") from e
        pinned, owned = pin_host(cp, pool.base_address, g.size)
        address = int(memory.ptr)
        tier = cls(device, address, g.slot_bytes, g.slots, memory, pinned, pool.data_address)
        tier.unpin = pool.base_address if owned else 0
        return tier

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def buffer(self) -> GpuBuffer:
        return GpuBuffer(self.address, self.nbytes, self.device, self.memory)

    def slot_address(self, slot: int) -> int:
        """The GPU address the directory publishes for the block in `slot`."""
        return self.address + slot * self.slot_bytes

    def upload(self, slots: Sequence[int], timeout_s: float) -> None:
        """Host copies of `slots` (fetched over a host path) into the device slots by the
        GPU's copy engines: one cudaMemcpyAsync per run of consecutive slots (slot s sits
        at the same offset in both), then a wait. Not the copy kernel: a kernel reading
        host memory holds its SMs for as long as PCIe takes, beside other engines'
        forward passes on this GPU."""
        if not slots:
            return
        deadline = time.perf_counter() + timeout_s
        cp = load_cupy()
        sb = self.slot_bytes
        try:
            with cp.cuda.Device(self.device):
                stream = cp.cuda.Stream.null
                for a, b in slot_runs(slots, self.slots):
                    cp.cuda.runtime.memcpyAsync(
                        self.address + a * sb, self.host_data + a * sb, (b - a) * sb,
                        _HOST_TO_DEVICE, stream.ptr,
                    )  # fmt: skip
                done = cp.cuda.Event(disable_timing=True)
                done.record(stream)
            wait_event(done, deadline, "upload of host copies to the GPU tier")
        except cuda_errors(cp) as e:
            raise TransferError(f"upload to the GPU tier failed: {e}") from e

    def read_slots(
        self,
        src_pointer: int,
        src_slot_bytes: int,
        src_slots: int,
        src_ids: Sequence[int] | np.ndarray,
        dst_ids: Sequence[int] | np.ndarray,
        timeout_s: float,
    ) -> int:
        """Whole slots of another tier mapped here (a same-host peer's, through CUDA
        IPC, at `src_pointer`) into ours: src_ids[i] -> dst_ids[i], one kernel on the
        legacy default stream (after a timed-out read of the same slots). Each slot
        moves as pieces of at most 64 KiB, each a thread block, with the slot ids
        uploaded rather than a segment table: at 512 slots of 2 MiB on the H200 the
        segment-list read took 2.2 ms, this kernel 0.6 (bench/results/gpu-2026-12-01.md).
        Returns bytes moved once they landed; TransferError past the deadline."""
        deadline = time.perf_counter() + timeout_s
        if src_slot_bytes < self.slot_bytes:
            raise TransferError(f"peer slots of {src_slot_bytes} B, ours of {self.slot_bytes} B")
        planes, segment = slot_pieces(self.slot_bytes)
        src = slot_planes(src_pointer, src_slots, src_slot_bytes, planes, segment)
        dst = slot_planes(self.address, self.slots, self.slot_bytes, planes, segment)
        if self._copier is None:
            self._copier = BlockCopier(self.device)
        cp = load_cupy()
        try:
            done = self._copier.launch(src, src_ids, dst, dst_ids, segment)
            if done is None:
                return 0
            wait_event(done, deadline, "cuda read")
        except cuda_errors(cp) as e:
            raise TransferError(f"cuda read failed: {e}") from e
        return len(dst_ids) * self.slot_bytes

    def close(self) -> None:
        cp = load_cupy()
        if self.unpin:
            with contextlib.suppress(*cuda_errors(cp)):
                cp.cuda.runtime.hostUnregister(self.unpin)
            self.unpin = 0
        self.memory = None


def pin_host(cp: Any, address: int, nbytes: int) -> tuple[bool, bool]:
    """Page-lock [address, +nbytes) for the GPU: (pinned, by this call).

    Already registered in this process (the agent's tier and a test's movers
    share one mapping) counts as pinned; only whoever pinned it unpins it."""
    try:
        cp.cuda.runtime.hostRegister(address, nbytes, HOST_REGISTER_PORTABLE_MAPPED)
    except cuda_errors(cp) as e:
        if "AlreadyRegistered" in str(e):
            return True, False
        log.warning("cudaHostRegister of the pool failed; host copies are pageable: %s", e)
        return False, False
    return True, True
