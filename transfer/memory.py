"""Registered host memory: shared, page-aligned buffers and the rkey table.

A node's KV pool is a file under /dev/shm mapped MAP_SHARED: the engine, the
agent and same-host peers (read-only) all map the same pages, so no byte is
copied between them. `Registry` is the holder's table of what it exposed:
every incoming read is checked against it (address range and rkey), so a peer
can read only what was registered, under the key it was given.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import threading
from dataclasses import dataclass

from kvdir.transfer.base import AccessDenied, Region

PAGE_BYTES = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Fault every page in at map time: a pool is meant to be resident, and faulting
4 KiB pages one by one on a first transfer made it 5-25x slower than later ones."""
SHM_DIR = "/dev/shm"


def copy(dst: memoryview, src: memoryview, chunk_bytes: int = 16 << 20) -> None:
    """`dst[:] = src` in chunks that release the GIL (ctypes.memmove drops it).

    A slice assignment of hundreds of MiB is one memcpy under the GIL and
    stalls every other thread of the process (the agent's RPC handlers) for
    its whole length.
    """
    n = len(dst)
    if n != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {n}")
    if n < chunk_bytes:
        dst[:] = src
        return
    d = _address_any(dst)
    s = _address_any(src)
    for off in range(0, n, chunk_bytes):
        ctypes.memmove(d + off, s + off, min(chunk_bytes, n - off))


def _address_any(mv: memoryview) -> int:
    """Address of a buffer's first byte, read-only buffers included."""
    if not mv.readonly:
        return buffer_address(mv)
    import numpy as np  # read-only mmaps refuse ctypes' from_buffer

    return int(np.frombuffer(mv, np.uint8).ctypes.data)


def buffer_address(mv: memoryview) -> int:
    """The virtual address of a writable buffer's first byte."""
    holder = ctypes.c_char.from_buffer(mv)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # drop the buffer export at once


@dataclass
class SharedMemory:
    """A MAP_SHARED mapping of a file (normally under /dev/shm)."""

    path: str
    size: int
    mm: mmap.mmap
    owner: bool

    @classmethod
    def create(cls, path: str, size: int) -> SharedMemory:
        """Create (or truncate) `path` to `size` bytes, rounded up to whole pages."""
        size = -(-size // PAGE_BYTES) * PAGE_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Transparent huge pages for shmem when the kernel allows it (fewer
            # TLB misses on multi-GB pools); a no-op where shmem THP is off.
            with contextlib.suppress(OSError):
                mm.madvise(mmap.MADV_HUGEPAGE)
        return cls(path, size, mm, owner=True)

    @classmethod
    def open_readonly(cls, path: str) -> SharedMemory:
        return cls._open(path, writable=False, owner=False)

    @classmethod
    def open_readwrite(cls, path: str, owner: bool = True) -> SharedMemory:
        """Map an existing file read-write (an agent re-attaching, or the engine)."""
        return cls._open(path, writable=True, owner=owner)

    @classmethod
    def _open(cls, path: str, writable: bool, owner: bool) -> SharedMemory:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, prot)
        finally:
            os.close(fd)
        return cls(path, size, mm, owner=owner)

    def view(self) -> memoryview:
        return memoryview(self.mm)

    def close(self, unlink: bool | None = None) -> None:
        # BufferError: someone still holds a view; the mapping goes when they drop it.
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.owner if unlink is None else unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class Registry:
    """rkey -> registered region, for checking incoming reads (holder side)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.SystemRandom()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Region, memoryview]] = {}

    def register(self, mv: memoryview, rkey: int | None = None) -> Region:
        """Grant reads of `mv`. Registering the same buffer again returns its region,
        so every backend of one engine shares one rkey (what the directory publishes);
        a backend whose hardware issues keys (RDMA) passes its own `rkey`."""
        address = buffer_address(mv)
        with self._lock:
            for region, _ in self._regions.values():
                if region.address == address and region.length == mv.nbytes:
                    return region
            if rkey is None:
                rkey = 0
                while rkey == 0 or rkey in self._regions:
                    rkey = self._rng.getrandbits(32)
            elif rkey in self._regions:
                raise ValueError(f"rkey {rkey:#x} is already registered")
            region = Region(address, mv.nbytes, rkey)
            self._regions[rkey] = (region, mv.cast("B") if mv.format != "B" else mv)
            return region

    def deregister(self, rkey: int) -> None:
        with self._lock:
            self._regions.pop(rkey, None)

    def regions(self) -> list[Region]:
        with self._lock:
            return [r for r, _ in self._regions.values()]

    def resolve(self, address: int, rkey: int, length: int) -> memoryview:
        """The registered bytes [address, address+length) under `rkey`, or AccessDenied."""
        with self._lock:
            entry = self._regions.get(rkey)
        if entry is None:
            raise AccessDenied(f"rkey {rkey:#x} was never granted")
        region, mv = entry
        if length <= 0 or not region.contains(address, length):
            raise AccessDenied(
                f"{length} bytes at {address:#x} fall outside the region "
                f"{region.address:#x}+{region.length} of rkey {rkey:#x}"
            )
        off = address - region.address
        return mv[off : off + length]
