"""One run's fault rates (drawn from its seed) and its result."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from bench.sim.checks import Violation
from bench.sim.net import NetFaults

TRACE_LINES_MAX = 60
"""Lines of trace kept for a failure report (the newest)."""


@dataclass(frozen=True, slots=True)
class Knobs:
    """Every rate of one run, drawn from its seed."""

    net: NetFaults
    crash: float
    power_loss: float
    blackout: float
    """A power cut of every replica at once."""
    restart: float
    partition: float
    heal: float
    transfer: float
    compact: float
    op: float
    bulk: float
    dump_delay_steps_max: int
    compaction_min_entries: int
    compaction_min_time_s: float
    membership: float = 0.0
    """Per step: the chance of starting a membership change (`membership`)."""

    @classmethod
    def draw(cls, rng: random.Random) -> Knobs:
        net = NetFaults(
            loss=rng.choice([0.0, 0.01, 0.05, 0.2]),
            duplicate=rng.choice([0.0, 0.0, 0.02, 0.1]),
            reorder=rng.choice([0.0, 0.0, 0.05, 0.3]),
            delay_min_s=0.0005,
            delay_max_s=rng.choice([0.002, 0.01, 0.05, 0.2]),
        )
        return cls(
            net=net,
            crash=rng.choice([0.0, 0.001, 0.003, 0.01]),
            power_loss=rng.choice([0.0, 0.5, 1.0]),
            blackout=rng.choice([0.0, 0.0, 0.001, 0.003]),
            restart=rng.choice([0.02, 0.05, 0.2]),
            partition=rng.choice([0.0, 0.002, 0.01]),
            heal=rng.choice([0.01, 0.05]),
            transfer=rng.choice([0.0, 0.002, 0.01]),
            compact=rng.choice([0.0, 0.005, 0.02]),
            op=rng.choice([0.2, 0.5, 1.0]),
            bulk=rng.choice([0.0, 0.0, 0.003, 0.01]),
            dump_delay_steps_max=rng.choice([0, 5, 50]),
            compaction_min_entries=rng.choice([10, 30, 100, 20_000]),
            compaction_min_time_s=rng.choice([2.0, 6.0, 600.0]),
        )


@dataclass
class Result:
    seed: int
    steps: int
    replicas: int
    violations: list[Violation] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    """Every event of the run, in order (the full record; `tail` is what is printed)."""
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    """CPU seconds the run took (its process's time, not the wall clock)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def tail(self, lines: int = TRACE_LINES_MAX) -> list[str]:
        return self.trace[-lines:]

    def summary(self) -> str:
        kinds = sorted({v.kind for v in self.violations})
        head = f"seed {self.seed} ({self.replicas} replicas, {self.steps} steps)"
        if self.ok:
            return f"{head}: ok"
        return f"{head}: FAILED {', '.join(kinds)}\n  " + "\n  ".join(
            [str(v) for v in self.violations[:10]] + ["trace (last lines):"] + self.tail()
        )


__all__ = ["TRACE_LINES_MAX", "Knobs", "Result"]
