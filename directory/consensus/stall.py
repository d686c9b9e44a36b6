"""How late the Raft thread's ticks come, and how much of the wait was fdatasync.

A follower campaigns once it has heard nothing for its election timeout, so a
leader whose tick thread stops for longer than `election_min_s` causes an
election, whatever stopped it (the GIL held by another thread, a journal
fdatasync waiting behind another file's writeback). `TickWatch` measures the
gap between the starts of two ticks and the journal's fdatasync seconds inside
it; the replica logs each gap past its threshold ("raft thread stalled"), so a
bench or an operator can tell an election's cause from the replica's log.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stall:
    gap_s: float
    """From the start of the previous tick to the start of this one."""
    fdatasync_s: float
    """Of which the journal spent this long in fdatasync."""


class TickWatch:
    """Fed at the start of every tick with the clock and the journal's total sync seconds."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.longest_s = 0.0
        self.stalls = 0
        self._at: float | None = None
        self._synced_s = 0.0

    def tick(self, now: float, synced_s: float) -> Stall | None:
        """This tick's stall, if the gap since the last one exceeds the threshold."""
        at, before = self._at, self._synced_s
        self._at, self._synced_s = now, synced_s
        if at is None:
            return None
        gap = now - at
        self.longest_s = max(self.longest_s, gap)
        if gap <= self.threshold_s:
            return None
        self.stalls += 1
        return Stall(gap, synced_s - before)


__all__ = ["Stall", "TickWatch"]
