"""The watch hub: committed commands fanned out to watchers, bounded, no I/O.

The replica calls `committed(index, blob, namespace)` for every applied
command that changed (or may have changed) the table, on its apply path, in
log order; the hub appends a reference to the command's bytes to a bounded
history and to the buffer of every watcher whose filter it passes. Each
watcher's stream (directory/watch.py) drains its buffer with `take`.

Ordering contracts:
- `committed` is called after the command was applied to the table and before
  the replica's applied index counts it, so whoever reads an applied index R
  and then finds a watcher's buffer empty knows every command <= R was queued.
- A watcher opened with `open_from(n)` gets the history's commands after n,
  then every later one; a snapshot at index n plus that stream is the table
  at every later index (directory/watch.py opens snapshot watchers so).
- `reset(index)` (the replica installed a snapshot: its table jumped past
  commands the hub never saw) cuts every watcher off; they resume from their
  index and get a snapshot, since the history now starts at `index`.

Bounds (kvdir.directory.limits.WatchLimits): watchers, per-watcher buffer
(entries and bytes: a watcher past either is cut off, never the replica
slowed), history (entries and bytes), entries per batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

from kvdir.directory.limits import WatchLimits


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    blob: bytes
    namespace: str | None
    """The namespace the command touches; None: node-wide (every watcher gets it)."""


@dataclass(frozen=True, slots=True)
class Batch:
    entries: list[Entry]
    through: int
    """Every command up to this index has now been handed to the watcher."""


@dataclass(frozen=True, slots=True)
class Idle:
    through: int


@dataclass(frozen=True, slots=True)
class CutOff:
    reason: str
    """Stable token: watcher-too-slow | snapshot-installed | replica-stopping | no-leader."""
    message: str
    resume_from: int
    """The last index this watcher was handed: resume from it."""


class Refused(Exception):
    """A watch the hub cannot open; `code` names a gRPC status."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(eq=False, slots=True)
class Watcher:
    id: int
    namespaces: frozenset[str] | None
    after: int
    """The highest log index already considered for this watcher."""
    handed: int
    """The highest index handed out by `take` (what it may resume from)."""
    buffer: deque[Entry] = field(default_factory=deque)
    bytes: int = 0
    cut: CutOff | None = None
    on_cut: Callable[[], None] | None = None
    """Called (under the hub's lock: keep it short) when the watcher is cut off."""
    leaderless: int = 0
    """Heartbeats in a row sent while the replica had no leader (directory/watch.py)."""

    def wants(self, e: Entry) -> bool:
        return self.namespaces is None or e.namespace is None or e.namespace in self.namespaces


class WatchHub:
    def __init__(
        self, limits: WatchLimits, applied_index: Callable[[], int], start_index: int | None = None
    ) -> None:
        """`applied_index` is the replica's (read under the hub's lock); the
        history covers the commands after `start_index` (None: after the index
        given to `anchor`, and no watcher is admitted before it)."""
        assert limits.history_entries_max <= limits.buffer_entries_max
        assert limits.history_bytes_max <= limits.buffer_bytes_max
        self.limits = limits
        self._applied = applied_index
        self._cond = threading.Condition(threading.Lock())
        self._history: deque[Entry] = deque()
        self._history_bytes = 0
        self.covered_from = start_index or 0
        """The history holds every command after this index."""
        self.last_index = start_index or 0
        self._anchored = start_index is not None
        self._watchers: dict[int, Watcher] = {}
        self._ids = count(1)
        self.cut_offs = 0

    # ------------------------------------------------------- the apply side

    def committed(self, index: int, blob: bytes, namespace: str | None) -> None:
        """One applied command (log order, strictly increasing indexes)."""
        assert index > self.last_index, (index, self.last_index)
        e = Entry(index, blob, namespace)
        lim = self.limits
        with self._cond:
            self.last_index = index
            self._history.append(e)
            self._history_bytes += len(blob)
            while len(self._history) > lim.history_entries_max or (
                self._history_bytes > lim.history_bytes_max and len(self._history) > 1
            ):
                old = self._history.popleft()
                self._history_bytes -= len(old.blob)
                self.covered_from = old.index
            for w in self._watchers.values():
                if w.cut is None and index > w.after:
                    w.after = index
                    if w.wants(e):
                        self._queue(w, e)
            self._cond.notify_all()

    def anchor(self, index: int) -> None:
        """The history covers every command after `index` (the replica's listener
        sees each one after it); commands queued before this call are all later."""
        with self._cond:
            if not self._anchored:
                self._anchored = True
                self.covered_from = index
                self.last_index = max(self.last_index, index)

    def reset(self, index: int) -> None:
        """The table was replaced by a snapshot at `index`: everyone starts over."""
        with self._cond:
            self._history.clear()
            self._history_bytes = 0
            self.covered_from = self.last_index = index
            self._anchored = True
            for w in self._watchers.values():
                self._cut(w, "snapshot-installed", f"this replica installed a snapshot at {index}")
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            for w in self._watchers.values():
                self._cut(w, "replica-stopping", "this replica is stopping")
            self._cond.notify_all()

    def _queue(self, w: Watcher, e: Entry) -> None:
        lim = self.limits
        w.buffer.append(e)
        w.bytes += len(e.blob)
        if len(w.buffer) > lim.buffer_entries_max or w.bytes > lim.buffer_bytes_max:
            self._cut(
                w,
                "watcher-too-slow",
                f"the watcher fell more than {lim.buffer_entries_max} commands or "
                f"{lim.buffer_bytes_max} bytes behind",
            )

    def cut_off(self, w: Watcher, reason: str, why: str) -> CutOff:
        """Cut `w` off now (the stream saw a reason the hub cannot); its CutOff."""
        with self._cond:
            self._cut(w, reason, why)
            assert w.cut is not None
            return w.cut

    def _cut(self, w: Watcher, reason: str, why: str) -> None:
        if w.cut is not None:
            return
        w.cut = CutOff(reason, f"{why}; resume from index {w.handed}", w.handed)
        w.buffer.clear()
        w.bytes = 0
        self.cut_offs += 1
        if w.on_cut is not None:
            w.on_cut()

    # ------------------------------------------------------ the watch side

    def _admit(self) -> None:
        if len(self._watchers) >= self.limits.watchers_max:
            raise Refused(
                "RESOURCE_EXHAUSTED",
                "too-many-watchers",
                f"this replica serves {self.limits.watchers_max} watchers already; try another",
            )

    def open_from(
        self, from_index: int, namespaces: frozenset[str] | None, commit_index: int
    ) -> Watcher | None:
        """A watcher fed the commands after `from_index`; None if the history no
        longer holds them all (start from a snapshot instead)."""
        with self._cond:
            if not self._anchored:
                raise Refused(
                    "UNAVAILABLE", "not-ready", "watch is not attached on this replica yet"
                )
            newest = max(self.last_index, commit_index, self._applied())
            if from_index > newest:
                raise Refused(
                    "OUT_OF_RANGE",
                    "bad-from-index",
                    f"from_index {from_index} is past this replica's commit index {newest}",
                )
            if from_index < self.covered_from:
                return None
            self._admit()
            w = Watcher(next(self._ids), namespaces, max(from_index, self.last_index), from_index)
            for e in self._history:
                if e.index > from_index and w.wants(e):
                    self._queue(w, e)
            self._watchers[w.id] = w
            return w

    def close(self, w: Watcher) -> None:
        with self._cond:
            self._watchers.pop(w.id, None)
            w.buffer.clear()

    def take(self, w: Watcher, wait_s: float) -> Batch | Idle | CutOff:
        """What to send next: waits up to `wait_s` for commands (Idle: none came)."""
        lim = self.limits
        with self._cond:
            self._cond.wait_for(lambda: bool(w.buffer) or w.cut is not None, wait_s)
            if w.cut is not None:
                return w.cut
            if not w.buffer:
                # Read under the lock with the buffer empty: every command <= this
                # index went through `committed` already (module docstring).
                return Idle(max(self._applied(), w.handed))
            out: list[Entry] = []
            size = 0
            while w.buffer and len(out) < lim.event_entries_max:
                e = w.buffer[0]
                if out and size + len(e.blob) > lim.event_bytes_max:
                    break
                w.buffer.popleft()
                out.append(e)
                size += len(e.blob)
            w.bytes -= size
            w.handed = out[-1].index
            through = w.handed if w.buffer else max(w.handed, self._applied())
            return Batch(out, through)

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def history(self) -> Iterable[Entry]:
        """A copy of the history (tests, tools)."""
        with self._cond:
            return list(self._history)
