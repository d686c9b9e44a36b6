"""The pool file as a whole: its superblock, its epoch, and how it is made.

Superblock (page 0, little-endian): magic, version, slot_bytes, slots,
header offset, data offset, namespace length; at 48 the epoch (u64), at 56
the retired flag (u32); at 64 the namespace key (JSON). The slot headers and
data that follow are agent/pool.py's.

Epochs. One pool file is one incarnation of the pool, named by a random
64-bit epoch in its superblock; the agent hands it to engines in every
answer. A file is never re-initialised in place: a pool of another shape (or
one that must start empty) is a new file renamed over the old path, and the
old file's superblock is marked retired first. An engine still mapping the
old file therefore keeps valid pages (no SIGBUS, whatever the new shape) that
nobody else writes, sees `retired` or an answer's new epoch, and attaches
again.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import struct
from dataclasses import dataclass

from kvdir.transfer.memory import PAGE_BYTES, SharedMemory

MAGIC = b"KVDPOOL\x01"
VERSION = 2
HEADER_BYTES = 64
"""One slot header (agent/pool.py)."""

_SUPER = struct.Struct("<8sIQIQQI")  # magic, version, slot_bytes, slots, hdr off, data off, ns len
_EPOCH = struct.Struct("<Q")
_RETIRED = struct.Struct("<I")
EPOCH_OFFSET = 48
RETIRED_OFFSET = 56
NAMESPACE_OFFSET = 64
assert _SUPER.size <= EPOCH_OFFSET and RETIRED_OFFSET + _RETIRED.size <= NAMESPACE_OFFSET


class PoolError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Geometry:
    slot_bytes: int
    slots: int
    header_offset: int
    data_offset: int
    size: int

    @classmethod
    def of(cls, slot_bytes: int, slots: int) -> Geometry:
        if slot_bytes <= 0 or slots <= 0:
            raise PoolError("slot_bytes and slots must be > 0")
        header_offset = PAGE_BYTES
        data_offset = _round_up(header_offset + slots * HEADER_BYTES, PAGE_BYTES)
        return cls(slot_bytes, slots, header_offset, data_offset, data_offset + slots * slot_bytes)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def encode_namespace(namespace_key: str) -> bytes:
    ns = json.dumps(namespace_key).encode()
    if NAMESPACE_OFFSET + len(ns) > PAGE_BYTES:
        raise PoolError("namespace key does not fit the pool superblock")
    return ns


def epoch_of(buf: memoryview | mmap.mmap) -> int:
    """The epoch in a mapped pool file's superblock (read each time: it is shared)."""
    return int(_EPOCH.unpack_from(buf, EPOCH_OFFSET)[0])


def retired_of(buf: memoryview | mmap.mmap) -> bool:
    return bool(_RETIRED.unpack_from(buf, RETIRED_OFFSET)[0])


@dataclass(frozen=True, slots=True)
class Superblock:
    version: int
    slot_bytes: int
    slots: int
    header_offset: int
    data_offset: int
    epoch: int
    retired: bool
    namespace_key: str | None
    """None when the stored namespace is not readable."""


def read_superblock(buf: memoryview | bytes | mmap.mmap) -> Superblock | None:
    """The superblock of a mapped pool file of this version, or None."""
    if len(buf) < PAGE_BYTES:
        return None
    magic, version, slot_bytes, slots, hoff, doff, nlen = _SUPER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or nlen > PAGE_BYTES - NAMESPACE_OFFSET:
        return None
    try:
        ns = json.loads(bytes(buf[NAMESPACE_OFFSET : NAMESPACE_OFFSET + nlen]))
    except ValueError:
        ns = None
    return Superblock(
        version,
        slot_bytes,
        slots,
        hoff,
        doff,
        _EPOCH.unpack_from(buf, EPOCH_OFFSET)[0],
        bool(_RETIRED.unpack_from(buf, RETIRED_OFFSET)[0]),
        ns if isinstance(ns, str) else None,
    )


def fits(sb: Superblock, geo: Geometry, file_bytes: int) -> bool:
    """The superblock describes `geo` and the file is big enough to map it whole."""
    return (
        sb.slot_bytes == geo.slot_bytes
        and sb.slots == geo.slots
        and sb.header_offset == geo.header_offset
        and sb.data_offset == geo.data_offset
        and file_bytes >= geo.size
    )


def attach(path: str, geo: Geometry, namespace_key: str) -> SharedMemory | None:
    """Map an existing live pool of the same shape and namespace, or None."""
    try:
        if os.path.getsize(path) != _round_up(geo.size, PAGE_BYTES):  # created page-rounded
            return None
    except OSError:
        return None
    mem = SharedMemory.open_readwrite(path)
    sb = read_superblock(mem.mm)
    if sb is None or sb.retired or not fits(sb, geo, mem.size) or sb.namespace_key != namespace_key:
        mem.close(unlink=False)
        return None
    return mem


def _retire(path: str) -> None:
    """Mark the pool file at `path` replaced, so engines mapping it attach again."""
    try:
        mem = SharedMemory.open_readwrite(path, owner=False)
    except (OSError, ValueError):
        return  # absent, or not a mappable pool: nobody maps it as one
    try:
        if read_superblock(mem.mm) is not None:
            _RETIRED.pack_into(mem.mm, RETIRED_OFFSET, 1)
    finally:
        mem.close(unlink=False)


def create(path: str, geo: Geometry, ns: bytes) -> SharedMemory:
    """A new pool file of a new epoch, renamed over `path` (never truncated in place:
    an engine may still map the old one)."""
    _remove_leftovers(path)
    tmp = f"{path}.new-{os.getpid()}"
    mem = SharedMemory.create(tmp, geo.size)
    try:
        _SUPER.pack_into(
            mem.mm,
            0,
            MAGIC,
            VERSION,
            geo.slot_bytes,
            geo.slots,
            geo.header_offset,
            geo.data_offset,
            len(ns),
        )
        _EPOCH.pack_into(mem.mm, EPOCH_OFFSET, new_epoch())
        mem.mm[NAMESPACE_OFFSET : NAMESPACE_OFFSET + len(ns)] = ns
        _retire(path)
        os.replace(tmp, path)
    except BaseException:
        mem.close(unlink=True)
        raise
    mem.path = path
    return mem


def _remove_leftovers(path: str) -> None:
    """Unlink half-made pool files of agents that died while creating one."""
    head = os.path.basename(path) + ".new-"
    folder = os.path.dirname(path) or "."
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            pid = name.removeprefix(head)
            if name.startswith(head) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))


def new_epoch() -> int:
    """Random and never 0 (0 in a request means "no epoch given")."""
    return secrets.randbits(64) or 1
