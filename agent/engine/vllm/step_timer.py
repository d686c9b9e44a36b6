"""Timing the engine's prefill-sized forward passes, for the pull-cost model (plan.PullCost).

Worker side, inside vLLM: `start` before a forward (connector.start_load_kv), `stop`
after it was queued (wait_for_save), `done` for the ones that completed. On CPU the
forward ran in between (wall time); on CUDA two events on the engine's stream time it
and are read once they completed, never waited on.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvdir.agent.engine.vllm.plan import PREFILL_SAMPLE_TOKENS_MIN

STEP_TIMINGS_MAX = 64
"""Timed forward passes not yet completed that a worker keeps (past this it times none)."""


class StepTimer:
    """Times forward passes that compute at least PREFILL_SAMPLE_TOKENS_MIN tokens."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._open: tuple[int, Any] | None = None
        self._pending: list[tuple[int, Any, Any]] = []

    def start(self, tokens: int) -> None:
        self._open = None
        if tokens < PREFILL_SAMPLE_TOKENS_MIN or len(self._pending) >= STEP_TIMINGS_MAX:
            return
        self._open = (tokens, self._mark())

    def stop(self) -> None:
        if self._open is not None:
            tokens, begin = self._open
            self._pending.append((tokens, begin, self._mark()))
            self._open = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def done(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of timed steps that completed since the last call."""
        out, keep = [], []
        for tokens, begin, end in self._pending:
            if not self.cuda:
                out.append((tokens, end - begin))
            elif end.query():
                out.append((tokens, begin.elapsed_time(end) / 1e3))
            else:
                keep.append((tokens, begin, end))
        self._pending = keep
        return out
