"""Prometheus metrics of a node agent (one registry per agent)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvdir.core.sharded_mirror import ShardedMirror
from kvdir.transfer.rdma_support import RdmaErrors

if TYPE_CHECKING:
    from kvdir.agent.directory_reads import MirrorReads

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RdmaErrorsCollector(Collector):
    """kvdir_agent_rdma_errors_total{kind,status} from the rdma transport's counts.

    Exported on every agent (zeros where rdma is not configured), so one
    alert rule covers every node and a missing series means a missing agent.
    """

    def __init__(self, errors: RdmaErrors) -> None:
        self.errors = errors

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "kvdir_agent_rdma_errors",
            "RDMA failures by kind: completion (error status), deadline (QP flushed), "
            "connect, post, flush, accept (holder side)",
            labels=["kind", "status"],
        )
        for (kind, status), n in sorted(self.errors.snapshot().items()):
            fam.add_metric([kind, status], n)
        yield fam


class MirrorCollector(Collector):
    """kvdir_agent_mirror_*: the directory mirror's position, lag and who answered.

    Read at scrape time from the mirror (one `lag()` per scrape). Registered
    only when `directory_mirror` is on: an agent without a mirror has none of
    these series rather than a mirror that looks stale. `lookups{source}`
    is named and typed as the gateway's kvdir_gateway_mirror_lookups."""

    def __init__(self, reads: MirrorReads) -> None:
        self.reads = reads

    def collect(self) -> Iterator[Metric]:
        lag = self.reads.lag()
        lookups = GaugeMetricFamily(
            "kvdir_agent_mirror_lookups",
            "Directory lookups so far (fetch path and engine Lookup), by who answered: the "
            "in-process mirror, or the RPC path while the mirror was stale",
            labels=["source"],
        )
        lookups.add_metric(["mirror"], self.reads.served)
        lookups.add_metric(["rpc"], self.reads.fallbacks)
        yield lookups
        m, sync = self.reads.mirror, self.reads.sync
        for name, doc, value in (
            ("applied_index", "Last directory log index the mirror applied", lag.applied_index),
            ("commit_index", "The leader's commit index as last heard", lag.commit_index),
            ("lag_entries", "Committed entries not yet applied by the mirror", lag.entries),
            ("lag_seconds", "How long the oldest unapplied commit has waited", lag.ms / 1000),
            ("silent_seconds", "Since the stream last sent anything", lag.silent_ms / 1000),
            ("fresh", "1 while the mirror answers lookups; 0: they go over gRPC", lag.fresh),
            ("snapshots", "Snapshots the mirror loaded (its first, and resyncs)", m.snapshots),
            ("streams", "Watch streams opened (the first, and each resume)", sync.streams),
        ):
            yield GaugeMetricFamily(f"kvdir_agent_mirror_{name}", doc, value=float(value))
        if isinstance(m, ShardedMirror):
            yield from _group_lags(m)


def _group_lags(m: ShardedMirror) -> Iterator[Metric]:
    """kvdir_agent_mirror_group_*{group}: a sharded directory's mirror, per group (the
    totals above sum the groups' indexes; a stale group's blocks are misses)."""
    lags = m.group_lags()
    families = (
        ("applied_index", "Last log index the group's mirror applied"),
        ("lag_seconds", "How long the group's oldest unapplied commit has waited"),
        ("fresh", "1 while the group's blocks are answered in process; 0: misses"),
    )
    values: dict[str, list[tuple[str, float]]] = {name: [] for name, _ in families}
    for gl in lags:
        values["applied_index"].append((gl.group_id, float(gl.lag.applied_index)))
        values["lag_seconds"].append((gl.group_id, gl.lag.ms / 1000))
        values["fresh"].append((gl.group_id, float(gl.lag.fresh)))
    for name, doc in families:
        fam = GaugeMetricFamily(f"kvdir_agent_mirror_group_{name}", doc, labels=["group"])
        for group, value in values[name]:
            fam.add_metric([group], value)
        yield fam


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rdma_errors = RdmaErrors()
        r.register(RdmaErrorsCollector(self.rdma_errors))
        self.queue_depth = Gauge(
            "kvdir_agent_publish_queue_depth", "Changes waiting to be published", registry=r
        )
        self.publish_drops = Gauge(
            "kvdir_agent_publish_dropped",
            "Changes dropped because the queue was full (resync repairs)",
            registry=r,
        )
        self.published = Gauge(
            "kvdir_agent_published_entries", "Store changes published to the directory", registry=r
        )
        self.publish_failures = Gauge(
            "kvdir_agent_publish_failures",
            "Publish batches that failed and were requeued",
            registry=r,
        )
        self.publish_seconds = Gauge(
            "kvdir_agent_publish_last_seconds", "Time the last publish batch took", registry=r
        )
        self.engine_dropped = Counter(
            "kvdir_agent_engine_notifications_dropped_total",
            "Notifications the engine library dropped",
            registry=r,
        )
        self.stale_notifications = Counter(
            "kvdir_agent_stale_notifications_total",
            "stored notifications that no longer matched the slot header",
            registry=r,
        )
        self.lookups = Counter("kvdir_agent_lookups_total", "Engine lookups", registry=r)
        self.lookup_socket_refused = Counter(
            "kvdir_agent_lookup_socket_refused_connections_total",
            "Engine connections to the lookup socket closed at its bound (those engines "
            "ask over gRPC: slower, not wrong)",
            registry=r,
        )
        self.fetches = Counter(
            "kvdir_agent_fetches_total", "Fetches by outcome", ["outcome"], registry=r
        )
        self.fetch_seconds = Histogram(
            "kvdir_agent_fetch_seconds", "Fetch latency", buckets=_SECONDS, registry=r
        )
        self.fetch_blocks = Counter(
            "kvdir_agent_fetch_blocks_total", "Blocks fetched valid", registry=r
        )
        self.fetch_bytes = Counter(
            "kvdir_agent_fetch_bytes_total", "Bytes fetched, by backend", ["transport"], registry=r
        )
        self.transfer_seconds = Counter(
            "kvdir_agent_transfer_seconds_total",
            "Seconds spent in fetch transfers, by backend (bytes / seconds = bandwidth)",
            ["transport"],
            registry=r,
        )
        self.validation_failures = Counter(
            "kvdir_agent_validation_failures_total",
            "Fetched blocks whose holder header no longer matched (slot reused)",
            registry=r,
        )
        self.pool_free_slots = Gauge(
            "kvdir_agent_pool_free_slots", "Free slots by pool", ["pool"], registry=r
        )
        self.pool_evictions = Counter(
            "kvdir_agent_pool_evictions",
            "Stored blocks evicted (least recently used) to make room for an allocation",
            registry=r,
        )

    def bind(
        self,
        *,
        queue_depth: Callable[[], float],
        drops: Callable[[], float],
        published: Callable[[], float],
        failures: Callable[[], float],
        publish_seconds: Callable[[], float],
    ) -> None:
        self.queue_depth.set_function(queue_depth)
        self.publish_drops.set_function(drops)
        self.published.set_function(published)
        self.publish_failures.set_function(failures)
        self.publish_seconds.set_function(publish_seconds)

    def bind_mirror(self, reads: MirrorReads) -> None:
        self.registry.register(MirrorCollector(reads))
