"""A progress bar on stderr (no dependency): redrawn at most every `interval_s`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 30
NON_TTY_INTERVAL_S = 10.0


class Progress:
    def __init__(
        self,
        what: str,
        total: int,
        stream: TextIO | None = None,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self._tty = self.stream.isatty()
        if not self._tty:
            self.interval_s = max(interval_s, NON_TTY_INTERVAL_S)  # a log, not a screen
        self._last = clock()

    def line(self, done: int) -> str:
        frac = min(1.0, done / self.total)
        filled = round(frac * BAR_WIDTH)
        elapsed = self.clock() - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return (
            f"{self.what:<8} [{bar}] {done:>6}/{self.total} {frac * 100:5.1f}% "
            f"{elapsed:6.1f}s eta {eta:5.0f}s"
        )

    def __call__(self, done: int) -> None:
        now = self.clock()
        if done < self.total and now - self._last < self.interval_s:
            return
        self._last = now
        end = "\n" if done >= self.total or not self._tty else "\r"
        self.stream.write(self.line(done) + end)
        self.stream.flush()
