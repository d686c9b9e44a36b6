"""A follower's append acknowledgements, held until the entries they cover are durable.

pysyncobj's follower appends the entries of an AppendEntries and answers at
once. With kvdir's journal an appended entry is only *staged*, so the answer
that says "I hold everything up to N" - which the leader counts toward a
commit - must wait for a sync. `AckGate` holds such answers and releases them
after one `sync()`: every append that arrived in one pass of the Raft thread's
poll shares one fdatasync (group commit), and the answers go out in the order
they were made.

Ordering contracts:
- `release()` syncs before it sends anything, so no success answer leaves
  before the entries it covers are durable.
- An answer that claims nothing (a rejection, a transmission step) is sent
  in order: whatever is held goes first (`hold` releases before it returns
  False), so the leader never sees an older success after a newer answer.
- A held answer must still be true when it is sent: when the log's tail is
  cut (a new leader's conflicting entries), held answers are dropped
  (`discard`), never sent - an answer may always be lost, and the leader
  simply sends again.

Runs on the Raft thread only (pysyncobj's transport is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Reply = dict[str, Any]
"""Keyword arguments of pysyncobj's `__sendNextNodeIdx` (reset, nextNodeIdx, success)."""


class Syncable(Protocol):
    @property
    def unsynced(self) -> bool: ...

    def sync(self) -> int: ...


class AckGate:
    """Holds success answers until `release()`; see the module docstring."""

    def __init__(self, journal: Syncable, send: Callable[[Any, Reply], None]) -> None:
        self._journal = journal
        self._send = send
        self._held: list[tuple[Any, Reply]] = []
        self.held_total = 0
        """Answers that waited for a sync (for tests and metrics)."""

    def hold(self, node: Any, reply: Reply) -> bool:
        """True if the answer was held; False: the caller sends it now (after what was held)."""
        if reply.get("success") and self._journal.unsynced:
            self._held.append((node, reply))
            self.held_total += 1
            return True
        self.release()
        return False

    def release(self) -> int:
        """If answers are held: sync the journal, then send them in order. Returns the batch."""
        batch = self._journal.sync() if self._held and self._journal.unsynced else 0
        held, self._held = self._held, []
        for node, reply in held:
            self._send(node, reply)
        return batch

    def discard(self) -> int:
        """Drop every held answer (the entries they cover are being cut). Returns how many."""
        n, self._held = len(self._held), []
        return n

    @property
    def holding(self) -> int:
        return len(self._held)


__all__ = ["AckGate", "Reply"]
