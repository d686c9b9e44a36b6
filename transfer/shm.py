"""The `shm` backend: same-host peers map the holder's pool read-only.

The same-host analogue of a one-sided read: the reader maps the holder's
/dev/shm pool file PROT_READ and copies straight into its destination; the
holder's CPU does nothing. The descriptor names the file, its inode, the
holder's base address and the region's rkey, and the host's boot id; a reader
refuses a peer on another host (or another boot), a file that is not the one
described (an agent restart recreated it), and reads under any other rkey.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence

from transfer.base import (
    AccessDenied,
    Channel,
    PeerUnavailable,
    Read,
    Region,
    Transport,
    check_destination,
    coalesce,
)
from transfer.memory import Registry, SharedMemory, buffer_address


def host_identity() -> str:
    """Same value for every process of one booted host, different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


class ShmChannel(Channel):
    def __init__(self, descriptor: dict[str, str]) -> None:
        if descriptor.get("host_id") != host_identity():
            raise PeerUnavailable("shm peer is on another host")
        self.path = descriptor["path"]
        self.base = int(descriptor["address"])
        self.rkey = int(descriptor["rkey"])
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise PeerUnavailable(f"shm pool {self.path} is gone: {e}") from e
        if str(st.st_ino) != descriptor["inode"]:
            raise PeerUnavailable(f"shm pool {self.path} was recreated (agent restart)")
        self.mem = SharedMemory.open_readonly(self.path)
        self.region = Region(self.base, min(int(descriptor["length"]), self.mem.size), self.rkey)
        self._src = self.mem.view()
        self._lock = threading.Lock()

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        check_destination(reads, len(dst))
        merged = coalesce(reads)
        for r in merged:
            if r.rkey != self.rkey:
                raise AccessDenied(f"rkey {r.rkey:#x} is not this pool's")
            if not self.region.contains(r.remote_address, r.length):
                raise AccessDenied(
                    f"{r.length} bytes at {r.remote_address:#x} fall outside the pool"
                )
        moved = 0
        with self._lock:
            src = self._src
            for r in merged:
                off = r.remote_address - self.base
                dst[r.dst_offset : r.dst_offset + r.length] = src[off : off + r.length]
                moved += r.length
        return moved

    def close(self) -> None:
        with self._lock:
            self._src.release()
            self.mem.close(unlink=False)


class ShmTransport(Transport):
    """Exposes one pool file; `register` must be given a view of that file's mapping."""

    name = "shm"

    def __init__(self, memory: SharedMemory, registry: Registry | None = None) -> None:
        self.memory = memory
        self.registry = registry or Registry()
        self._region: Region | None = None

    def register(self, memory: memoryview) -> Region:
        if buffer_address(memory) != buffer_address(self.memory.view()):
            raise ValueError("the shm transport exposes only its pool file's mapping")
        self._region = self.registry.register(memory)
        return self._region

    def descriptor(self) -> dict[str, str]:
        if self._region is None:
            raise RuntimeError("register the pool before describing it")
        return {
            "transport": self.name,
            "path": self.memory.path,
            "inode": str(os.stat(self.memory.path).st_ino),
            "address": str(self._region.address),
            "length": str(self._region.length),
            "rkey": str(self._region.rkey),
            "host_id": host_identity(),
        }

    def connect(self, descriptor: dict[str, str]) -> Channel:
        return ShmChannel(descriptor)

    def close(self) -> None:
        if self._region is not None:
            self.registry.deregister(self._region.rkey)
