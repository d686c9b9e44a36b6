"""Timed RPC load from the client worker processes, summarised the same way for every phase.

`measure` runs pre-serialized requests against one replica for a duration,
`concurrency` calls in flight spread over the worker processes, and returns
rate, latency statistics, errors, the replica's CPU per call and the
machine's busy share. `pool` merges several such slices (the A B B A order).
The raw latencies ride along under `_lat` / `_idx` until `strip` drops them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench.directory.cluster import Bench, merge_errors
from bench.host import machine_cpu, proc_cpu_s
from bench.measure import ms_stats_from_ns
from bench.workers import CallResult, CallTask
from kvdir.local import Replica

CALLS_PER_S_MAX = 50_000
"""Bounds one task's calls: `duration_s` times this."""
WARMUP_CALLS = 5


def _tasks(
    target: Replica,
    method: str,
    response: str,
    reqs: list[bytes],
    procs: int,
    threads: int,
    duration_s: float,
) -> list[CallTask]:
    start_at = time.time() + 0.5
    return [
        CallTask(
            target.grpc_address,
            method,
            response,
            reqs,
            start_at,
            duration_s,
            max_calls=int(duration_s * CALLS_PER_S_MAX),
            threads=threads,
            first=(w * len(reqs)) // procs,
            warmup_calls=WARMUP_CALLS,
            timeout_s=10.0,
        )
        for w in range(procs)
    ]


@dataclass(frozen=True, slots=True)
class Calls:
    """One kind of call: the method, its response type, the pre-serialized requests."""

    method: str
    response: str
    reqs: list[bytes]


def _run(
    b: Bench, target: Replica, calls: Calls, concurrency: int, duration_s: float
) -> tuple[list[CallResult], dict[str, Any]]:
    method, response, reqs = calls.method, calls.response, calls.reqs
    procs = min(b.pool.size, concurrency)
    threads = math.ceil(concurrency / procs)
    tasks = _tasks(target, method, response, reqs, procs, threads, duration_s)
    assert target.proc is not None
    pid = target.proc.pid
    c0, p0 = machine_cpu(), proc_cpu_s(pid)
    res = b.pool.run(tasks, timeout_s=duration_s + 60)
    c1, p1 = machine_cpu(), proc_cpu_s(pid)
    return res, {
        "calls": sum(r.calls for r in res),
        "window_s": max(r.finished for r in res) - min(r.started for r in res),
        "server_cpu_s": p1 - p0,
        "machine_busy_cpu_s": c1[0] - c0[0],
        "machine_total_cpu_s": c1[1] - c0[1],
    }


def _summary(
    concurrency: int,
    calls: int,
    window_s: float,
    lat: list[int],
    idx: list[int],
    errors: dict[str, int],
    server_cpu_us: float,
    machine_cpu_busy: float,
) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "calls": calls,
        "per_s": calls / window_s if window_s > 0 else math.nan,
        **ms_stats_from_ns(lat),
        "errors": errors,
        "server_cpu_us_per_call": server_cpu_us / calls if calls else math.nan,
        "machine_cpu_busy": machine_cpu_busy,
        "_lat": lat,
        "_idx": idx,
    }


def measure(
    b: Bench, target: Replica, calls: Calls, concurrency: int, duration_s: float
) -> dict[str, Any]:
    """Run the calls for `duration_s` (one client task per process) and summarise."""
    res, agg = _run(b, target, calls, concurrency, duration_s)
    total = agg["machine_total_cpu_s"]
    return _summary(
        concurrency,
        agg["calls"],
        agg["window_s"],
        [x for r in res for x in r.latencies_ns],
        [x for r in res for x in r.indices],
        merge_errors(res),
        agg["server_cpu_s"] * 1e6,
        agg["machine_busy_cpu_s"] / total if total > 0 else math.nan,
    )


def pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several `measure` slices of the same calls."""
    errors: dict[str, int] = {}
    for p in parts:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return _summary(
        parts[0]["concurrency"],
        sum(p["calls"] for p in parts),
        sum(p["calls"] / p["per_s"] for p in parts if p["per_s"] > 0),
        [x for p in parts for x in p["_lat"]],
        [x for p in parts for x in p["_idx"]],
        errors,
        sum(p["server_cpu_us_per_call"] * p["calls"] for p in parts if p["calls"]),
        statistics.fmean(p["machine_cpu_busy"] for p in parts),
    )


def strip(*ms: dict[str, Any]) -> None:
    """Drop the raw samples before the summaries go into the results."""
    for m in ms:
        m.pop("_lat", None)
        m.pop("_idx", None)
