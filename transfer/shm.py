"""The `shm` backend: same-host peers map the holder's pool read-only.

The same-host analogue of a one-sided read: the reader maps the holder's
/dev/shm pool file PROT_READ and copies straight into its destination; the
holder's CPU does nothing. The descriptor lists each exposed pool file
(path, inode, the holder's base address, length, rkey) and the host's boot
id; a reader refuses a peer on another host (or another boot), a file that is
not the one described (an agent restart recreated it), and reads under an
rkey it was not given.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdir.transfer.base import (
    AccessDenied,
    Channel,
    PeerUnavailable,
    Read,
    Region,
    Transport,
    check_destination,
    coalesce,
)
from kvdir.transfer.memory import Registry, SharedMemory, buffer_address, copy


def host_identity() -> str:
    """Same value for every process of one booted host, different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@dataclass
class _Mapped:
    region: Region
    mem: SharedMemory
    view: memoryview


class ShmChannel(Channel):
    """Read-only mappings of a same-host peer's pool files, one per region (rkey)."""

    def __init__(self, descriptor: dict[str, str]) -> None:
        if descriptor.get("host_id") != host_identity():
            raise PeerUnavailable("shm peer is on another host")
        self._maps: dict[int, _Mapped] = {}
        self._lock = threading.Lock()
        try:
            for spec in json.loads(descriptor["regions"]):
                self._maps[int(spec["rkey"])] = self._map(spec)
        except (KeyError, ValueError, TypeError) as e:
            self.close()
            raise PeerUnavailable(f"bad shm descriptor: {e}") from e
        except PeerUnavailable:
            self.close()
            raise

    @staticmethod
    def _map(spec: dict[str, Any]) -> _Mapped:
        path = str(spec["path"])
        try:
            st = os.stat(path)
        except OSError as e:
            raise PeerUnavailable(f"shm pool {path} is gone: {e}") from e
        if st.st_ino != int(spec["inode"]):
            raise PeerUnavailable(f"shm pool {path} was recreated (agent restart)")
        mem = SharedMemory.open_readonly(path)
        region = Region(int(spec["address"]), min(int(spec["length"]), mem.size), int(spec["rkey"]))
        return _Mapped(region, mem, mem.view())

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        check_destination(reads, len(dst))
        merged = coalesce(reads)
        for r in merged:
            m = self._maps.get(r.rkey)
            if m is None:
                raise AccessDenied(f"rkey {r.rkey:#x} was never granted")
            if not m.region.contains(r.remote_address, r.length):
                raise AccessDenied(
                    f"{r.length} bytes at {r.remote_address:#x} fall outside "
                    f"the region of rkey {r.rkey:#x}"
                )
        moved = 0
        with self._lock:
            for r in merged:
                m = self._maps[r.rkey]
                off = r.remote_address - m.region.address
                copy(dst[r.dst_offset : r.dst_offset + r.length], m.view[off : off + r.length])
                moved += r.length
        return moved

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                m.view.release()
                m.mem.close(unlink=False)
            self._maps.clear()


class ShmTransport(Transport):
    """Exposes pool files; `register` takes a view of one of their mappings."""

    name = "shm"

    def __init__(self, memories: Sequence[SharedMemory], registry: Registry | None = None) -> None:
        self.memories = list(memories)
        self.registry = registry or Registry()
        self._regions: list[tuple[Region, SharedMemory]] = []

    def register(self, memory: memoryview) -> Region:
        address = buffer_address(memory)
        for mem in self.memories:
            view = mem.view()
            try:
                if buffer_address(view) == address and view.nbytes == memory.nbytes:
                    region = self.registry.register(memory)
                    if all(r != region for r, _ in self._regions):
                        self._regions.append((region, mem))
                    return region
            finally:
                view.release()
        raise ValueError("the shm transport exposes only whole pool-file mappings")

    def descriptor(self) -> dict[str, str]:
        regions = [
            {
                "path": mem.path,
                "inode": os.stat(mem.path).st_ino,
                "address": r.address,
                "length": r.length,
                "rkey": r.rkey,
            }
            for r, mem in self._regions
        ]
        return {"transport": self.name, "regions": json.dumps(regions), "host_id": host_identity()}

    def connect(self, descriptor: dict[str, str]) -> Channel:
        return ShmChannel(descriptor)

    def close(self) -> None:
        for r, _ in self._regions:
            self.registry.deregister(r.rkey)
        self._regions.clear()
