"""GPU memory for RDMA through dma-buf. UNVERIFIED: no machine available to this
project has both an NVIDIA GPU and an RDMA device, so this path has never run.

What it does: export a CUDA allocation as a dma-buf file descriptor
(`cuMemGetHandleForAddressRange`, CUDA >= 11.7, needs the open GPU kernel
modules or a driver with dma-buf support) and register it with the RDMA
device (`ibv_reg_dmabuf_mr` through pyverbs' DmaBufMR, rdma-core >= 34,
kernel >= 5.12), LOCAL_WRITE | REMOTE_READ as for host pools. pyverbs 44
registers the dma-buf with iova = offset, so peers address the region from
`offset`, not by the GPU virtual address: the returned `GpuRegion.address` is
what a holder would publish.

Not wired in: the agent's pools are host memory, and `RdmaChannel.read`
derives local addresses from host memoryviews; a GPU-resident pool needs the
fetch path to address destinations as (lkey, iova) instead. Kept separate so
nothing here loads unless called.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


class GpuDirectUnavailable(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class GpuRegion:
    address: int
    """The iova peers read from (pyverbs registers with iova = offset)."""
    length: int
    rkey: int
    lkey: int
    mr: Any
    fd: int

    def close(self) -> None:
        self.mr.close()
        os.close(self.fd)


def dmabuf_fd(device_pointer: int, length: int) -> int:
    """A dma-buf fd for [device_pointer, +length) of CUDA memory (page-aligned, allocated)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GpuDirectUnavailable(f"no CUDA driver library: {e}") from e
    fd = ctypes.c_int(-1)
    rc = cuda.cuMemGetHandleForAddressRange(
        ctypes.byref(fd),
        ctypes.c_uint64(device_pointer),
        ctypes.c_size_t(length),
        ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD),
        ctypes.c_ulonglong(0),
    )
    if rc != 0 or fd.value < 0:
        raise GpuDirectUnavailable(
            f"cuMemGetHandleForAddressRange failed (CUresult {rc}): dma-buf export needs "
            "CUDA >= 11.7 and a driver with dma-buf support (the open kernel modules)"
        )
    return fd.value


def register_gpu(pd: Any, device_pointer: int, length: int) -> GpuRegion:
    """Register CUDA memory with the RDMA device `pd` belongs to (REMOTE_READ only)."""
    try:
        import pyverbs.enums as e
        from pyverbs.mr import DmaBufMR
    except ImportError as err:
        raise GpuDirectUnavailable(f"pyverbs with DmaBufMR is needed: {err}") from err
    fd = dmabuf_fd(device_pointer, length)
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
    try:
        mr = DmaBufMR(pd, length, access, dmabuf=fd, offset=0)
    except Exception as err:
        os.close(fd)
        raise GpuDirectUnavailable(f"ibv_reg_dmabuf_mr failed: {err}") from err
    return GpuRegion(0, length, int(mr.rkey), int(mr.lkey), mr, fd)
