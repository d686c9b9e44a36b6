"""How bytes reach stable storage, and how much durability a replica buys.

Every write that must survive a power cut goes through a `Syncer`, so tests
can count syncs or fail one (the only seam; the files are real). A rename is
durable only once its directory is synced too: `replace_durably` does both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum


class Durability(Enum):
    """What an acknowledged log entry survives (docs/directory.md, "Durability contract")."""

    POWER_LOSS = "power-loss"
    """The default: entries are fdatasync'd (in batches) before the replica
    acknowledges them, so an acknowledged write survives the power loss of
    every replica."""
    PROCESS_CRASH = "process-crash"
    """Entries reach the kernel (write()) before they are acknowledged and are
    fdatasync'd about once a second, off the acknowledgement path. Survives a
    process crash; a kernel crash or power loss may lose up to a second of
    acknowledged writes on each replica it hits, so losing a majority that way
    can lose acknowledged writes. Terms and votes stay durable."""

    @classmethod
    def parse(cls, text: str) -> Durability:
        for mode in cls:
            if mode.value == text:
                return mode
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"durability must be one of {names}, not {text!r}")


def fsync_dir(path: str) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Syncer:
    """The calls that make data durable: `file(fd)` and `directory(path)`."""

    file: Callable[[int], None] = os.fdatasync
    directory: Callable[[str], None] = fsync_dir


REAL = Syncer()


def replace_durably(tmp: str, path: str, syncer: Syncer = REAL) -> None:
    """Rename `tmp` over `path` and sync the directory, so the rename survives a power cut."""
    os.replace(tmp, path)
    syncer.directory(os.path.dirname(os.path.abspath(path)))


FREE_STEP_BYTES = 8 << 20
"""A replaced file's blocks are freed this many bytes at a time (`replace_freeing_later`)."""


def replace_freeing_later(tmp: str, path: str, syncer: Syncer = REAL) -> None:
    """`replace_durably`, but the replaced file's blocks are freed on another thread, in steps.

    The call that drops a big file's last reference frees its blocks there and
    then: a rename over a 120 MB journal took 80 ms, over 400 MB 264 ms, on the
    bench host (ext4 mounted with online discard), and other files' fdatasync
    waited up to 60-110 ms meanwhile. A Raft thread must not do that (a journal
    rewrite after a compaction replaced the whole log file on it). So the old
    file is held open across the rename, then truncated FREE_STEP_BYTES at a
    time and closed by a daemon thread. A crash meanwhile leaves an orphan
    inode, which the filesystem frees when it is next mounted; the new file is
    in place and durable before this returns, as with `replace_durably`.
    """
    try:
        old = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        old = -1
    try:
        replace_durably(tmp, path, syncer)
    except BaseException:
        if old >= 0:
            os.close(old)  # still the file at `path`: never truncate it
        raise
    if old >= 0:
        threading.Thread(target=_free, args=(old,), name="kvdir-free", daemon=True).start()


def _free(fd: int) -> None:
    try:
        size = os.fstat(fd).st_size
        while size > 0:
            size = max(0, size - FREE_STEP_BYTES)
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def write_atomically(path: str, chunks: Iterable[bytes], syncer: Syncer = REAL) -> None:
    """Write `path` so that a reader finds the old file or the whole new one, never a part.

    Order: a temp file next to `path`, every byte written, fsync, rename,
    fsync of the directory. An interruption anywhere leaves `path` as it was
    (and at worst a stale temp file, which the next write replaces).
    """
    tmp = path + ".kvdir-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in chunks:
            write_all(fd, chunk)
        syncer.file(fd)
    finally:
        os.close(fd)
    replace_durably(tmp, path, syncer)


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """os.write / os.pwrite until every byte is written (they may write less)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


__all__ = [
    "REAL",
    "Durability",
    "Syncer",
    "fsync_dir",
    "replace_durably",
    "replace_freeing_later",
    "write_all",
    "write_atomically",
]
