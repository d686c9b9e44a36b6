"""A backend's load as the router sees it: in-flight requests and the engine's own signals.

Pure: no I/O, no clock. The unit is requests, what `CostModel.load_penalty_s`
and the balance guard take (kvdir/routing/policy.py).

Why both signals: the in-flight count is exact and instant but covers only
the requests of this gateway process; an engine's own gauges (vLLM's
`/metrics`: requests running and waiting, KV-cache usage) cover every client,
other gateways and the other workers of this one included, but are as old as
the last poll. So the estimate is the engine's count at the poll plus what this
process sent (or saw finish) since, never below this process's own in-flight:

    queued = max(inflight, running + waiting + (inflight - inflight_at_poll))
    load   = queued + waiting_weight * waiting + kv_weight * kv_pressure

A waiting request counts again, `waiting_weight` more (it queues behind a full
batch, where a running one shares the batch); KV-cache usage past `kv_knee`
adds up to `kv_weight` requests when full (a full cache makes the engine
queue or preempt whatever comes next). Without engine signals the load is the
in-flight count, as before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading of an engine's scheduler gauges."""

    running: float
    waiting: float
    kv_usage: float
    """Fraction of the KV cache in use, 0..1 (vLLM's `kv_cache_usage_perc` is a fraction)."""
    inflight_at_poll: int = 0
    """This process's in-flight count to the engine when the reading was taken."""

    def __post_init__(self) -> None:
        assert self.running >= 0 and self.waiting >= 0, self
        assert 0 <= self.kv_usage <= 1 and self.inflight_at_poll >= 0, self


@dataclass(frozen=True, slots=True)
class LoadWeights:
    waiting: float = 1.0
    """Extra load of one waiting request, in requests."""
    kv: float = 8.0
    """Load added by a full KV cache, in requests."""
    kv_knee: float = 0.8
    """KV-cache usage below which the cache adds nothing."""

    def __post_init__(self) -> None:
        assert self.waiting >= 0 and self.kv >= 0 and 0 <= self.kv_knee < 1, self


DEFAULT_WEIGHTS = LoadWeights()


def kv_pressure(kv_usage: float, knee: float) -> float:
    """0 up to `knee`, rising linearly to 1 at a full cache."""
    return max(0.0, min(1.0, (kv_usage - knee) / (1.0 - knee)))


def backend_load(
    inflight: int, engine: EngineLoad | None, weights: LoadWeights = DEFAULT_WEIGHTS
) -> float:
    """The load of one backend in requests (see the module docstring for the formula)."""
    if engine is None:
        return float(inflight)
    since = inflight - engine.inflight_at_poll
    queued = max(float(inflight), engine.running + engine.waiting + since)
    return (
        queued
        + weights.waiting * engine.waiting
        + weights.kv * kv_pressure(engine.kv_usage, weights.kv_knee)
    )


__all__ = ["DEFAULT_WEIGHTS", "EngineLoad", "LoadWeights", "backend_load", "kv_pressure"]
