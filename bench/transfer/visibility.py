"""Phase: time from `stored()` to the block being visible, next to a direct Publish.

Each trial stores one new block on A, then polls reader B's
`EngineClient.lookup` (another process) and then every replica until the
block shows; interleaved trial by trial with the baseline: a directory
Publish from this process, then the same polling. The difference is the
engine client's and agent's pipeline.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench.measure import deadline_loop, ms_stats_from_s, say
from bench.transfer.config import NS_SMALL, PROBE_NODE, VISIBLE_TIMEOUT_S
from bench.transfer.setup import Bench
from kvdir.local import LOOPBACK
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

JITTER_S = 0.01
"""Up to this random pause between trials, so trials do not lock onto batch windows."""
PROBE_LEASE_MS = 600_000


@dataclass(slots=True)
class _Seen:
    """One stored-to-visible trial."""

    polls: int = 0
    poll_s: float = 0.0
    reader_s: float | None = None
    all_s: float | None = None


def _left_s(t0: float) -> float:
    """What is left of the trial's VISIBLE_TIMEOUT_S (it counts from the store or publish)."""
    return VISIBLE_TIMEOUT_S - (time.perf_counter() - t0)


def _at_reader(b: Bench, ns: pb.Namespace, h: bytes, node_id: str, t0: float, seen: _Seen) -> None:
    reader_b = b.clients["reader-b"]
    t_poll = time.perf_counter()
    for _ in deadline_loop(_left_s(t0), b.cfg.poll_gap_s, clock=time.perf_counter):
        seen.polls += 1
        r = reader_b.lookup(ns, [h])
        if any(p.node_id == node_id and p.prefix_blocks >= 1 for p in r.peers):
            seen.reader_s = time.perf_counter() - t0
            break
    seen.poll_s = (time.perf_counter() - t_poll) / max(1, seen.polls)


def _everywhere(b: Bench, ns: pb.Namespace, h: bytes, node_id: str, t0: float) -> float | None:
    assert b.directory is not None
    pending = list(b.cluster.grpc_addresses)
    for _ in deadline_loop(_left_s(t0), b.cfg.poll_gap_s, clock=time.perf_counter):
        pending = [
            addr
            for addr in pending
            if not any(
                m.node_id == node_id
                for m in b.directory.lookup(ns, [h], address=addr, omit_records=True).matches
            )
        ]
        if not pending:
            return time.perf_counter() - t0
    return None


def _until_visible(b: Bench, ns: pb.Namespace, h: bytes, node_id: str, t0: float) -> _Seen:
    """Poll reader B's lookup, then every replica, until `node_id` holds `h`."""
    seen = _Seen()
    _at_reader(b, ns, h, node_id, t0, seen)
    if seen.reader_s is not None:
        seen.all_s = _everywhere(b, ns, h, node_id, t0)
    return seen


def _trials(b: Bench, probe_inc: int) -> tuple[dict[str, list[_Seen]], list[float]]:
    ns = NS_SMALL
    assert b.directory is not None
    alloc = b.a.allocate(ns, b.cfg.visibility_trials)
    runs: dict[str, list[_Seen]] = {"stored": [], "publish": []}
    publish_call: list[float] = []
    for slot in alloc.slots:
        h = os.urandom(8)
        t0 = time.perf_counter()
        b.a.stored(ns, [h], [slot])
        runs["stored"].append(_until_visible(b, ns, h, "holder-a", t0))
        time.sleep(b.rng.uniform(0.0, JITTER_S))  # trials independent of batch windows
        h = os.urandom(8)
        t0 = time.perf_counter()
        b.directory.publish(PROBE_NODE, probe_inc, ns, pb.TIER_HOST, [h], [4096], [1], [1], [1])
        publish_call.append(time.perf_counter() - t0)
        runs["publish"].append(_until_visible(b, ns, h, PROBE_NODE, t0))
        time.sleep(b.rng.uniform(0.0, JITTER_S))
    b.a.free(ns, alloc.slots)
    return runs, publish_call


def _summary(seen: list[_Seen]) -> dict[str, Any]:
    reader = [x.reader_s for x in seen if x.reader_s is not None]
    every = [x.all_s for x in seen if x.all_s is not None]
    return {
        "timeouts": sum(1 for x in seen if x.reader_s is None or x.all_s is None),
        "poll_period_ms_mean": statistics.fmean(x.poll_s for x in seen) * 1e3,
        "polls_mean": statistics.fmean(x.polls for x in seen),
        "reader_lookup": ms_stats_from_s(reader) if reader else {},
        "all_replicas": ms_stats_from_s(every) if every else {},
        "reader_lookup_samples_ms": [x * 1e3 for x in reader],
    }


def run(b: Bench) -> None:
    """stored() -> visible, A/B-interleaved with a direct Publish -> visible."""
    trials = b.cfg.visibility_trials
    say(f"stored() to visible: {trials} trials")
    assert b.directory is not None
    probe_inc = time.time_ns()
    b.directory.register_node(PROBE_NODE, LOOPBACK, probe_inc, lease_ms=PROBE_LEASE_MS)
    runs, publish_call = _trials(b, probe_inc)
    b.directory.clear_node(PROBE_NODE, probe_inc, deregister=True)
    out: dict[str, Any] = {
        "trials": trials,
        "observer": "reader agent B's EngineClient.lookup (another process)",
        "baseline": "directory Publish from this process (acknowledged after the Raft "
        "commit), then the same polling",
        "publish_rpc": ms_stats_from_s(publish_call),
        **{name: _summary(seen) for name, seen in runs.items()},
    }
    b.results["visibility"] = out
    r, base = out["stored"]["reader_lookup"], out["publish"]["reader_lookup"]
    say(
        f"  stored() -> visible at the reader: p50 {fmt(r.get('median_ms'))} ms, "
        f"p99 {fmt(r.get('p99_ms'))} ms; Publish -> visible: p50 "
        f"{fmt(base.get('median_ms'))} ms, p99 {fmt(base.get('p99_ms'))} ms"
    )
