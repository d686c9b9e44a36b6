"""Measurement helpers every benchmark shares: one meaning per name, the unit in the name.

- `stats(values, unit_s, points)`: order statistics of durations given in
  seconds-per-unit `unit_s` (1e-9 for nanoseconds, 1.0 for seconds), reported
  in milliseconds (`ms_stats_from_ns`, `ms_stats_from_s`) or microseconds
  (`us_stats_from_ns`). Which statistics (p50 or median, min, p99.9, mean) a
  benchmark reports is a tuple of `Point`s, so each keeps its JSON keys.
  An empty sample gives `n` 0 and NaN for every statistic (never an error).
- `deadline_loop`: bounded polling. It yields 0, 1, 2, ... at most `polls_max`
  times and for at most `timeout_s` seconds, sleeping `interval_s` between
  polls, then simply ends; the caller decides whether running out is an error
  (it `return`s or `break`s on success and raises after the loop).
- `say`: one progress line on stderr, seconds since the benchmark started.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvdir import report

POLLS_MAX = 20_000
"""The most polls of one `deadline_loop` (a bound besides the time)."""

NS = 1e-9
"""Seconds per nanosecond: the `unit_s` of perf_counter_ns / latencies_ns samples."""
S = 1.0
"""Seconds per second: the `unit_s` of time.perf_counter() differences."""


@dataclass(frozen=True, slots=True)
class Point:
    """One reported statistic: `name` (key prefix) and percentile `q`, None for the mean."""

    name: str
    q: float | None


P50, MEDIAN, P90, P99, P999 = (
    Point("p50", 50),
    Point("median", 50),
    Point("p90", 90),
    Point("p99", 99),
    Point("p999", 99.9),
)
MIN, MAX, MEAN = Point("min", 0), Point("max", 100), Point("mean", None)

TAIL = (P50, P90, P99, MAX, MEAN)
"""n, p50, p90, p99, max, mean: the directory benchmark's latency summary."""
SPREAD = (MEDIAN, MIN, P90, P99, MAX, MEAN)
"""n, median, min, p90, p99, max, mean: a few repetitions of a long operation."""
DEEP_TAIL = (P50, P90, P99, P999, MAX, MEAN)
"""Down to p99.9: many short calls."""


def stats(
    values: Sequence[float], unit_s: float, out_unit_s: float, suffix: str, points: Sequence[Point]
) -> dict[str, float]:
    """`{name}_{suffix}` for each point of `values` (in units of `unit_s` seconds),
    converted to units of `out_unit_s` seconds; plus `n`."""
    scale = unit_s / out_unit_s
    s = sorted(v * scale for v in values)
    out: dict[str, float] = {"n": len(s)}
    for p in points:
        if not s:
            out[f"{p.name}_{suffix}"] = math.nan
        elif p.q is None:
            out[f"{p.name}_{suffix}"] = statistics.fmean(s)
        else:
            out[f"{p.name}_{suffix}"] = report.percentile(s, p.q)
    return out


def ms_stats_from_ns(nanos: Sequence[int], points: Sequence[Point] = TAIL) -> dict[str, float]:
    return stats(nanos, NS, 1e-3, "ms", points)


def ms_stats_from_s(seconds: Sequence[float], points: Sequence[Point] = SPREAD) -> dict[str, float]:
    return stats(seconds, S, 1e-3, "ms", points)


def us_stats_from_ns(nanos: Sequence[int], points: Sequence[Point] = DEEP_TAIL) -> dict[str, float]:
    return stats(nanos, NS, 1e-6, "us", points)


def deadline_loop(
    timeout_s: float,
    interval_s: float = 0.0,
    polls_max: int = POLLS_MAX,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[int]:
    """Yield 0, 1, ... until `timeout_s` passed or `polls_max` polls; then end (no raise)."""
    end = clock() + timeout_s
    for i in range(polls_max):
        if clock() >= end:
            return
        yield i
        if interval_s > 0:
            sleep(interval_s)


_T0 = time.monotonic()


def say(msg: str) -> None:
    """A progress line on stderr (never on stdout, which carries the Markdown)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


__all__ = [
    "DEEP_TAIL",
    "MAX",
    "MEAN",
    "MEDIAN",
    "MIN",
    "NS",
    "P50",
    "P90",
    "P99",
    "P999",
    "POLLS_MAX",
    "SPREAD",
    "TAIL",
    "Point",
    "S",
    "deadline_loop",
    "ms_stats_from_ns",
    "ms_stats_from_s",
    "say",
    "stats",
    "us_stats_from_ns",
]
