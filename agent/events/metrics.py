"""Prometheus view of event ingestion: counters read from each rank's stats.

The consumer threads bump plain ints (no lock, no prometheus call on the hot
path); this collector reads them at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvdir.agent.events.ingest import EngineIngest

_COUNTERS = (
    ("messages", "kvdir_agent_events_messages", "Event messages received"),
    ("batches_applied", "kvdir_agent_events_batches_applied", "Event batches applied"),
    ("events", "kvdir_agent_events_received", "Events decoded"),
    ("blocks_stored", "kvdir_agent_events_blocks_stored", "Block stores applied"),
    ("blocks_removed", "kvdir_agent_events_blocks_removed", "Block removals applied"),
    ("clears", "kvdir_agent_events_clears", "AllBlocksCleared applied"),
    ("decode_errors", "kvdir_agent_events_decode_errors", "Malformed messages or events skipped"),
    ("skipped_events", "kvdir_agent_events_skipped", "Events not indexed (group, block size)"),
    ("gaps", "kvdir_agent_events_gaps", "Sequence gaps detected"),
    ("gaps_unrecovered", "kvdir_agent_events_gaps_unrecovered", "Gaps replay could not fill"),
    ("batches_lost", "kvdir_agent_events_batches_lost", "Batches never received"),
    ("replays", "kvdir_agent_events_replays", "Replay requests sent"),
    ("replayed_batches", "kvdir_agent_events_replayed_batches", "Batches applied from replay"),
    ("restarts", "kvdir_agent_events_engine_restarts", "Engine restarts detected"),
    ("apply_failures", "kvdir_agent_events_apply_failures", "Batches that failed to apply"),
)


class EventsCollector(Collector):
    def __init__(self, ingests: Callable[[], Sequence[EngineIngest]]) -> None:
        self.ingests = ingests

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "rank"]
        fams = {a: CounterMetricFamily(n, h, labels=labels) for a, n, h in _COUNTERS}
        lag = GaugeMetricFamily(
            "kvdir_agent_events_lag_seconds",
            "Now minus the engine timestamp of the last applied batch",
            labels=labels,
        )
        seq = GaugeMetricFamily(
            "kvdir_agent_events_last_seq", "Last sequence number applied", labels=labels
        )
        checks = CounterMetricFamily(
            "kvdir_agent_events_hash_checks",
            "Hash self-test results (failed: lookups from tokens will not hit)",
            labels=["engine", "result"],
        )
        for ing in self.ingests():
            for c in ing.consumers:
                lv = [ing.cfg.name, str(c.rank)]
                for attr, fam in fams.items():
                    fam.add_metric(lv, getattr(c.stats, attr))
                lag.add_metric(lv, c.stats.lag_s)
                seq.add_metric(lv, c.stats.last_seq)
            if ing.selftest is not None:
                checks.add_metric([ing.cfg.name, "passed"], ing.selftest.stats.passed)
                checks.add_metric([ing.cfg.name, "failed"], ing.selftest.stats.failed)
        yield from fams.values()
        yield lag
        yield seq
        yield checks
