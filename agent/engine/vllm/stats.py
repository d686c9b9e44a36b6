"""kvdir's counters on vLLM's own stats path: logged by vLLM and on its /metrics.

Workers (and the scheduler side) hand vLLM a KvdirStats each step; vLLM
aggregates them in the front-end process, logs a summary and feeds
KvdirPromMetrics, whose series appear on `vllm serve`'s /metrics next to
vLLM's own vllm:external_prefix_cache_hits:

    kvdir:loaded_blocks_total{source}   source: pool (this node) or shm/tcp/rdma
    kvdir:loaded_bytes_total{source}
    kvdir:saved_blocks_total, kvdir:saved_bytes_total, kvdir:save_skipped_total
    kvdir:validation_misses_total       loads cut short by a reused slot
    kvdir:recomputed_blocks_total       promised blocks vLLM recomputed instead
    kvdir:retired_slots_total           pool slots never used again (a read into them
                                        outlived its deadline and may still land)
    kvdir:lookups_total, kvdir:lookup_timeouts_total, kvdir:agent_unavailable_total
    kvdir:lookups_skipped_total         requests vLLM's own cache covered (not looked up)
    kvdir:slow_pulls_skipped_total      pulls the cost model said lose to recomputing
    kvdir:load_seconds                  histogram, one observation per load
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvdir.agent.engine.vllm.scheduler import LookupCounts
from kvdir.agent.engine.vllm.worker import Stats

SCALARS = (
    "saved_blocks",
    "saved_bytes",
    "save_skipped",
    "validation_misses",
    "recomputed_blocks",
    "retired_slots",
    "lookups",
    "lookup_timeouts",
    "agent_unavailable",
    "slow_pulls_skipped",
    "lookups_skipped",
)
BY_SOURCE = ("loaded_blocks", "loaded_bytes")
SAMPLES = ("load_seconds", "peer_loads", "prefill_steps")
"""Per-event lists (the scheduler side's pull-cost model reads peer_loads and prefill_steps)."""
LOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def worker_data(s: Stats) -> dict[str, Any]:
    return {
        "loaded_blocks": dict(s.loaded_blocks),
        "loaded_bytes": dict(s.loaded_bytes),
        "saved_blocks": s.saved_blocks,
        "saved_bytes": s.saved_bytes,
        "save_skipped": s.save_skipped,
        "validation_misses": s.validation_misses,
        "recomputed_blocks": s.recomputed_blocks,
        "retired_slots": s.retired_slots,
        "load_seconds": list(s.load_seconds),
        "peer_loads": list(s.peer_loads),
        "prefill_steps": list(s.prefill_steps),
    }


def lookup_data(c: LookupCounts) -> dict[str, Any]:
    return {
        "lookups": c.lookups,
        "lookup_timeouts": c.timeouts,
        "agent_unavailable": c.agent_down,
        "slow_pulls_skipped": c.slow_pulls_skipped,
        "lookups_skipped": c.lookups_skipped,
    }


@dataclass
class KvdirStats(KVConnectorStats):  # type: ignore[misc]  # vLLM is untyped here
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"loaded_blocks": {}, "loaded_bytes": {}}
        for k in SAMPLES:
            self.data[k] = []

    def is_empty(self) -> bool:
        d = self.data
        return not (
            any(d.get(k) for k in SCALARS)
            or any(d.get(k) for k in BY_SOURCE)
            or any(d.get(k) for k in SAMPLES)
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o: dict[str, Any] = other.data
        for k in SCALARS:
            self.data[k] = self.data.get(k, 0) + o.get(k, 0)
        for k in BY_SOURCE:
            mine = self.data.setdefault(k, {})
            for src, n in o.get(k, {}).items():
                mine[src] = mine.get(src, 0) + n
        for k in SAMPLES:
            self.data.setdefault(k, []).extend(o.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        d: dict[str, Any] = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in SCALARS}
        for k in BY_SOURCE:
            for src, n in sorted(d.get(k, {}).items()):
                out[f"{k}_{src}"] = n
        secs = sorted(d.get("load_seconds", []))
        if secs:
            out["loads"] = len(secs)
            out["load_p50_ms"] = round(secs[len(secs) // 2] * 1e3, 3)
        return out


class KvdirPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._scalars = {
            k: self._counter_cls(
                name=f"kvdir:{k}_total",
                documentation=f"kvdir connector: {k}",
                labelnames=labelnames,
            )
            for k in SCALARS
        }
        self._by_source = {
            k: self._counter_cls(
                name=f"kvdir:{k}_total",
                documentation=f"kvdir connector: {k} by source (pool or transport)",
                labelnames=[*labelnames, "source"],
            )
            for k in BY_SOURCE
        }
        self._load_seconds = self._histogram_cls(
            name="kvdir:load_seconds",
            documentation="kvdir connector: seconds per load (pool and peer parts)",
            buckets=list(LOAD_SECONDS_BUCKETS),
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        d = transfer_stats_data or {}
        for k, counter in self._scalars.items():
            if d.get(k):
                counter.labels(*labels).inc(d[k])
        for k, counter in self._by_source.items():
            for src, n in d.get(k, {}).items():
                counter.labels(*labels, src).inc(n)
        for s in d.get("load_seconds", []):
            self._load_seconds.labels(*labels).observe(s)
