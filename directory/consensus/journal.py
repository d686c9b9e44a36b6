"""The Raft log as an append-only file of checksummed records, synced in batches.

Ordering contracts:
- `append` only stages an entry; `sync` writes every staged record in one
  write and (in `Durability.POWER_LOSS`) fdatasyncs once for the whole batch.
  An entry may be acknowledged - a follower's append reply, the leader's own
  vote in the commit count - only after a `sync` that returned after it was
  appended, or a `wait_durable` of its index (group commit: one fdatasync
  serves every entry staged since the last).
- Structural changes are durable before they return, in every mode:
  `truncate_from` (a Raft conflict) cuts the file and syncs before any later
  record can land after the cut; `drop_before`, `reanchor` and `clear`
  (compaction, loading a snapshot) write a new file and rename it into place
  durably.
- On open, a torn tail (the unsynced part of the last batch) is cut and
  synced; damage that a later record proves was durable raises
  `JournalCorrupt` with one line naming the file, the byte and the way out.

Not thread-safe: pysyncobj calls it from its Raft thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvdir.directory.consensus import records
from kvdir.directory.consensus.records import Entry
from kvdir.directory.consensus.sync import (
    REAL,
    Durability,
    Syncer,
    replace_freeing_later,
    write_all,
)

log = logging.getLogger("kvdir.directory.journal")

LOG_FILE = "raft-log.bin"
"""The Raft log in a data dir."""

RECOVER_HINT = (
    "stop this replica and rebuild it: let it rejoin empty (move its data dir aside) "
    "or use `kvdir directory recover` / `kvdir directory restore` (docs/operations.md)"
)


class JournalCorrupt(RuntimeError):
    """Durable journal bytes are damaged: the replica must not start on them."""


class JournalFailed(RuntimeError):
    """A write or fdatasync failed earlier: the journal refuses all further work.

    After a failed fdatasync the kernel may have dropped the dirty pages and
    a retry can "succeed" without them, so nothing after it may be
    acknowledged; the replica must stop and restart from what is on disk.
    """


@dataclass(slots=True)
class SyncStats:
    """Group-commit counters: how many entries each fdatasync covered."""

    syncs: int = 0
    entries: int = 0
    largest_batch: int = 0
    sync_s: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Power-of-two bucket (1, 2, 4, ...) -> batches whose size rounds up to it."""

    def record(self, entries: int, seconds: float) -> None:
        self.syncs += 1
        self.entries += entries
        self.largest_batch = max(self.largest_batch, entries)
        self.sync_s += seconds
        bucket = 1 << max(entries - 1, 0).bit_length()
        self.batch_sizes[bucket] = self.batch_sizes.get(bucket, 0) + 1


def read_only(path: str) -> list[Entry]:
    """The entries a journal holds, read without changing it (a torn tail left out).

    Raises JournalCorrupt where opening it for a replica would.
    """
    with open(path, "rb") as f:
        buf = f.read()
    try:
        found = records.scan(buf)
    except ValueError as e:
        raise JournalCorrupt(f"{path}: {e}") from e
    if found.corrupt:
        raise JournalCorrupt(_corrupt_line(path, found))
    return found.entries


def _corrupt_line(path: str, found: records.Scan) -> str:
    return (
        f"{path}: the record at byte {found.end} is damaged ({found.damage}) "
        f"although the record at byte {found.witness} shows it had been synced; {RECOVER_HINT}"
    )


class LogFile:
    """The log of one replica, in memory and in `path` (see the module's contracts)."""

    def __init__(
        self,
        path: str,
        durability: Durability = Durability.POWER_LOSS,
        syncer: Syncer = REAL,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.path = path
        self.durability = durability
        self.syncer = syncer
        self.stats = SyncStats()
        self._clock = clock
        self.entries: list[Entry] = []
        self._offsets: list[int] = []
        self._staged: list[bytes] = []
        self._staged_entries = 0
        self._unsynced_entries = 0
        """Entries written to the file since the last fdatasync."""
        self._fd = -1
        self._failed: BaseException | None = None
        self._written = 0
        """File offset up to which records have been written (staged ones are beyond)."""
        self._end = 0
        """File offset after the last staged record."""
        self._synced_to = 0
        """File offset up to which the file is known durable."""
        self._open()

    # ------------------------------------------------------------------ open

    def _open(self) -> None:
        if not os.path.exists(self.path):
            self._write_file([])
        with open(self.path, "rb") as f:
            buf = f.read()
        try:
            found = records.scan(buf)
        except ValueError as e:
            raise JournalCorrupt(f"{self.path}: {e}; {RECOVER_HINT}") from e
        if found.corrupt:
            raise JournalCorrupt(_corrupt_line(self.path, found))
        self._fd = os.open(self.path, os.O_RDWR)
        if found.end < len(buf):
            self._cut(found.end, len(buf) - found.end, found.damage)
        self.entries, self._offsets = found.entries, found.offsets
        self._written = self._end = self._synced_to = found.end

    def _cut(self, at: int, nbytes: int, why: str) -> None:
        log.warning(
            "journal: cut a torn tail",
            extra={"path": self.path, "at_byte": at, "bytes": nbytes, "reason": why},
        )
        os.ftruncate(self._fd, at)
        self.syncer.file(self._fd)

    def _write_file(self, entries: list[Entry]) -> None:
        """`entries` as a new file at `path`, made durable, then renamed into place."""
        tmp = self.path + ".kvdir-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            chunk = [records.file_header()]
            chunk += [records.encode(idx, term, 0, cmd) for cmd, idx, term in entries]
            write_all(fd, b"".join(chunk))
            self.syncer.file(fd)
        finally:
            os.close(fd)
        replace_freeing_later(tmp, self.path, self.syncer)  # runs on the Raft thread

    # --------------------------------------------------------------- appends

    def _usable(self) -> None:
        if self._failed is not None:
            raise JournalFailed(f"{self.path}: an earlier write failed ({self._failed})")

    def append(self, command: bytes, index: int, term: int) -> None:
        """Stage one entry; durable only after the next `sync`."""
        self._usable()
        if self.entries:
            last = self.entries[-1]
            assert index == last[1] + 1 and term >= last[2], (index, term, last[1:])
        rec = records.encode(index, term, self._synced_to, bytes(command))
        self.entries.append((bytes(command), index, term))
        self._offsets.append(self._end)
        self._staged.append(rec)
        self._staged_entries += 1
        self._end += len(rec)

    @property
    def unsynced(self) -> bool:
        """True while some appended entry is not yet as durable as the mode promises."""
        return self._staged_entries > 0

    def sync(self) -> int:
        """Write the staged batch; in POWER_LOSS mode fdatasync it. Returns its entry count."""
        self._usable()
        batch = self._write_staged()
        if batch and self.durability is Durability.POWER_LOSS:
            self._fdatasync()
        return batch

    def wait_durable(self, index: int) -> None:
        """Return once the entry at Raft `index` (and all before it) is as durable as promised."""
        if not self.entries or index < self.entries[0][1]:
            return
        pos = min(index - self.entries[0][1], len(self.entries) - 1)
        end = self._offsets[pos + 1] if pos + 1 < len(self._offsets) else self._end
        durable = self._synced_to if self.durability is Durability.POWER_LOSS else self._written
        if end > durable:
            self.sync()

    def sync_every_second(self) -> None:
        """The once-a-second durability of PROCESS_CRASH mode (POWER_LOSS is already synced)."""
        self._usable()
        self._write_staged()
        if self._written > self._synced_to:
            self._fdatasync()

    def _write_staged(self) -> int:
        batch = self._staged_entries
        if not batch:
            return 0
        data = b"".join(self._staged)
        self._guarded(lambda: write_all(self._fd, data, self._written))
        self._written += len(data)
        self._staged, self._staged_entries = [], 0
        self._unsynced_entries += batch
        return batch

    def _fdatasync(self) -> None:
        t0 = self._clock()
        self._guarded(lambda: self.syncer.file(self._fd))
        self._synced_to = self._written
        self.stats.record(self._unsynced_entries, self._clock() - t0)
        self._unsynced_entries = 0

    def _guarded(self, io: Callable[[], None]) -> None:
        try:
            io()
        except OSError as e:
            self._failed = e
            raise

    # ------------------------------------------------------ structural changes

    def truncate_from(self, pos: int) -> None:
        """Drop entries[pos:] (a conflicting tail), durably before returning."""
        self._usable()
        if pos >= len(self.entries):
            return
        cut = self._offsets[pos]
        self._write_staged()
        del self.entries[pos:], self._offsets[pos:]
        self._guarded(lambda: os.ftruncate(self._fd, cut))
        self._guarded(lambda: self.syncer.file(self._fd))
        self._written = self._end = self._synced_to = cut
        self._unsynced_entries = 0

    def drop_before(self, pos: int) -> None:
        """Drop entries[:pos] (they are in a durable snapshot) by rewriting the file."""
        self._usable()
        self._rewrite(self.entries[pos:])

    def reanchor(self, prev: Entry, last: Entry) -> int:
        """Start the log at a snapshot's anchors `prev`, `last`; returns the entries kept.

        Raft's rule for a snapshot: when our log holds the snapshot's last
        entry (same index, same term), the entries after it stay; otherwise
        the whole log goes. One durable rewrite, so a crash leaves the old
        log or the new one (never an empty one).
        """
        self._usable()
        assert prev[1] + 1 == last[1], (prev[1:], last[1:])
        pos = last[1] - self.entries[0][1] if self.entries else -1
        at = self.entries[pos] if 0 <= pos < len(self.entries) else None
        keep = self.entries[pos + 1 :] if at is not None and at[2] == last[2] else []
        self._rewrite([prev, last, *keep])
        return len(keep)

    def _rewrite(self, keep: list[Entry]) -> None:
        """`keep` becomes the whole log, durably, in place of the file."""
        os.close(self._fd)
        self._fd = -1
        self._staged, self._staged_entries, self._unsynced_entries = [], 0, 0
        self._guarded(lambda: self._write_file(keep))
        self._fd = os.open(self.path, os.O_RDWR)
        self.entries = keep
        self._offsets = []
        pos_in_file = records.HEADER_BYTES
        for cmd, _, _ in keep:
            self._offsets.append(pos_in_file)
            pos_in_file += records.RECORD_OVERHEAD_BYTES + len(cmd)
        self._written = self._end = self._synced_to = pos_in_file

    def clear(self) -> None:
        """Drop every entry (a snapshot from the leader replaces the log)."""
        self.drop_before(len(self.entries))

    def close(self) -> None:
        """Sync what is staged (in either mode: a clean stop loses nothing) and close."""
        if self._fd < 0:
            return
        if self._failed is not None:
            os.close(self._fd)
            self._fd = -1
            return
        self._write_staged()
        if self._written > self._synced_to:
            self._fdatasync()
        os.close(self._fd)
        self._fd = -1


__all__ = [
    "LOG_FILE",
    "RECOVER_HINT",
    "JournalCorrupt",
    "JournalFailed",
    "LogFile",
    "SyncStats",
    "read_only",
]
