"""Prometheus metrics of one directory replica (one registry per replica).

Gauges that mirror Raft or table state are read at scrape time through
callbacks, so the hot paths pay only for counters and histograms.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
_BATCH_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class DirectoryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpcs = Counter(
            "kvdir_directory_rpcs_total",
            "RPCs answered, by method and code",
            ["method", "code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "kvdir_directory_rpc_seconds",
            "RPC latency by method",
            ["method"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.publish_batch = Histogram(
            "kvdir_directory_publish_batch_entries",
            "Entries per Publish",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.lookup_chain = Histogram(
            "kvdir_directory_lookup_chain_blocks",
            "Blocks per lookup chain",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.write_outcomes = Counter(
            "kvdir_directory_write_outcomes_total", "Raft write outcomes", ["outcome"], registry=r
        )
        self.barriers = Counter(
            "kvdir_directory_read_barriers_total",
            "Linearizable reads served (each waited on a barrier)",
            registry=r,
        )
        self.lease_expiries = Counter(
            "kvdir_directory_lease_expiries_total",
            "Nodes dropped because their lease expired",
            registry=r,
        )
        self.compaction_seconds = Histogram(
            "kvdir_directory_compaction_seconds",
            "Log compaction time (capture + write)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.role = Gauge(
            "kvdir_directory_raft_role", "0 follower, 1 candidate, 2 leader", registry=r
        )
        self.term = Gauge("kvdir_directory_raft_term", "Current Raft term", registry=r)
        self.commit_index = Gauge(
            "kvdir_directory_raft_commit_index", "Raft commit index", registry=r
        )
        self.applied_index = Gauge(
            "kvdir_directory_raft_applied_index", "Last Raft index applied to the table", registry=r
        )
        self.has_leader = Gauge(
            "kvdir_directory_raft_has_leader", "1 when this replica knows a leader", registry=r
        )
        self.entries = Gauge("kvdir_directory_entries", "(block, holder) records held", registry=r)
        self.nodes = Gauge("kvdir_directory_nodes", "Registered holder nodes", registry=r)
        self.namespaces = Gauge("kvdir_directory_namespaces", "Namespaces seen", registry=r)
        self.shard_group = Gauge(
            "kvdir_directory_shard_group",
            "1, labelled with this replica's shard group (docs/sharding.md)",
            ["group"],
            registry=r,
        )
        self.shard_map_version = Gauge(
            "kvdir_directory_shard_map_version",
            "Version of the shard map this replica routes by (0: none yet, or unsharded)",
            registry=r,
        )

    def bind(
        self,
        *,
        role: Callable[[], float],
        term: Callable[[], float],
        commit_index: Callable[[], float],
        applied_index: Callable[[], float],
        has_leader: Callable[[], float],
        entries: Callable[[], float],
        nodes: Callable[[], float],
        namespaces: Callable[[], float],
    ) -> None:
        """Attach the scrape-time readers of replica state."""
        self.role.set_function(role)
        self.term.set_function(term)
        self.commit_index.set_function(commit_index)
        self.applied_index.set_function(applied_index)
        self.has_leader.set_function(has_leader)
        self.entries.set_function(entries)
        self.nodes.set_function(nodes)
        self.namespaces.set_function(namespaces)

    def bind_shards(self, group: str, map_version: Callable[[], float]) -> None:
        """Per-group dashboards and alerts select replicas by the `group` label."""
        self.shard_group.labels(group).set(1)
        self.shard_map_version.set_function(map_version)
