"""Prometheus metrics of the gateway (one registry per gateway; served at /metrics).

With `workers > 1` every worker process keeps its own registry: a scrape of the
shared port reads whichever worker the kernel hands the connection to, so scrape
each worker at its own port (`worker_port_base + i`) and sum across them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_ADDED_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class GatewayMetrics:
    def child(self, name: str, *labels: str) -> Any:
        """`getattr(self, name).labels(*labels)`, memoized: labels() costs a lock and a
        dict lookup per call, several times per request on the hot path."""
        key = (name, *labels)
        c = self._children.get(key)
        if c is None:
            c = getattr(self, name).labels(*labels)
            self._children[key] = c
        return c

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[str, ...], Any] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvdir_gateway_requests_total",
            "Requests answered, by endpoint and HTTP status (status 0: the stream broke)",
            ["endpoint", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "kvdir_gateway_decisions_total",
            "Routing decisions, by the policy applied and the rule that decided",
            ["policy", "rule"],
            registry=r,
        )
        self.degraded = Counter(
            "kvdir_gateway_degraded_decisions_total",
            "Decisions taken least-loaded because the directory could not answer in time",
            registry=r,
        )
        self.directory_up = Gauge(
            "kvdir_gateway_directory_up",
            "1 while directory lookups succeed; 0 while the gateway routes least-loaded",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvdir_gateway_prompt_tokens_total", "Prompt tokens routed", ["policy"], registry=r
        )
        self.hit_tokens = Counter(
            "kvdir_gateway_predicted_hit_tokens_total",
            "Prompt tokens predicted cached on the chosen node (local) or pulled from a peer",
            ["policy", "source"],
            registry=r,
        )
        self.unrouted = Counter(
            "kvdir_gateway_unkeyed_requests_total",
            "Requests routed without a prefix key, by reason",
            ["reason"],
            registry=r,
        )
        self.added = Histogram(
            "kvdir_gateway_added_seconds",
            "Time from the request's arrival to the backend request being sent",
            buckets=_ADDED_BUCKETS_S,
            registry=r,
        )
        self.stage = Histogram(
            "kvdir_gateway_stage_seconds",
            "Time of each routing stage (parse, tokenize, hash, lookup, decide)",
            ["stage"],
            buckets=_ADDED_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "kvdir_gateway_retries_total",
            "Requests re-sent to another backend after one failed before sending a byte",
            registry=r,
        )
        self.backend_errors = Counter(
            "kvdir_gateway_backend_errors_total",
            "Backend failures, by backend and stage (connect: before a byte; stream: after)",
            ["backend", "stage"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "kvdir_gateway_backend_healthy",
            "1 while the backend passes its health checks",
            ["backend"],
            registry=r,
        )
        self.backend_inflight = Gauge(
            "kvdir_gateway_backend_inflight",
            "Requests in flight to the backend",
            ["backend"],
            registry=r,
        )
        self.backend_load = Gauge(
            "kvdir_gateway_backend_load",
            "The backend's load as routed on: in-flight requests and its engine's own gauges",
            ["backend"],
            registry=r,
        )
        self.lookups = Gauge(
            "kvdir_gateway_mirror_lookups",
            "Prefix lookups so far with the mirror on, by who answered: the in-process "
            "mirror, or the RPC path while the mirror was stale",
            ["source"],
            registry=r,
        )
        self.worker = Gauge(
            "kvdir_gateway_worker",
            "1, labelled with this process's worker index (each worker has its own metrics)",
            ["worker"],
            registry=r,
        )
        # process_cpu_seconds_total and friends: the gateway's own CPU per request
        # (`kvdir bench gateway` divides it by the requests served).
        ProcessCollector(registry=r)
