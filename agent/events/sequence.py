"""Pure sequence tracking of one engine publisher (one DP rank).

vLLM numbers its batches 0, 1, 2, ... per publisher process. Given the next
live sequence number, `Sequencer.observe` says what to do:

- IN_ORDER: apply it.
- GAP: batches [expected, seq) were lost (a dropped message, or the ones sent
  before our subscription was up): replay them first, then apply.
- RESTART: the number went backwards, so the engine restarted and its cache
  is empty: clear what it held, then treat it as a first message.
- FIRST: the first message seen; when seq > 0 the earlier ones are replayed
  (the replay buffer may still hold the engine's whole history).

Replayed batches go through `accept_replayed`, which admits only the ones
still missing, in order.
"""

from __future__ import annotations

from enum import Enum


class Step(Enum):
    FIRST = "first"
    IN_ORDER = "in-order"
    GAP = "gap"
    RESTART = "restart"


class Sequencer:
    def __init__(self) -> None:
        self.expected: int | None = None
        """The next sequence number we have not applied (None before the first)."""

    def observe(self, seq: int) -> Step:
        """Classify a live message; does not advance (call `applied`)."""
        if self.expected is None:
            return Step.FIRST
        if seq == self.expected:
            return Step.IN_ORDER
        if seq > self.expected:
            return Step.GAP
        return Step.RESTART

    def reset(self) -> None:
        """After a restart: the next message is a first message again."""
        self.expected = None

    def missing_from(self, seq: int) -> int | None:
        """Where a replay must start before applying live `seq` (None: nothing missing)."""
        start = 0 if self.expected is None else self.expected
        return start if seq > start else None

    def accept_replayed(self, seq: int, live_seq: int) -> bool:
        """Whether a replayed batch is one we still miss (before the live one)."""
        start = 0 if self.expected is None else self.expected
        return start <= seq < live_seq

    def applied(self, seq: int) -> None:
        self.expected = seq + 1
