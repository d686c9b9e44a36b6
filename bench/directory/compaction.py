"""Phase: Raft log compaction on replicas holding the full load, terms watched across it.

The logs are grown past `compaction_min_entries` with one-entry Publish
commands; pysyncobj then compacts each replica only inside its own window.
Throughout, a writer keeps publishing, a prober times lookups on every
replica and a watcher polls every replica's term and leader, so the report
can say whether the compaction caused an election and what it cost callers.
The replicas' "raft thread stalled" lines across it say what held their Raft
threads (a tick gap, and how much of it was the journal's fdatasync).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from bench.directory import logs
from bench.directory.cluster import FILLER_NODE, NAMESPACE, PUBLISH, Bench
from bench.directory.threads import Prober, StatusWatch, retire_writer, start_writer
from bench.measure import deadline_loop, say
from bench.workers import CallTask
from kvdir.core.client import lookup_request
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.local import Replica
from kvdir.v1 import directory_pb2 as pb

FILL_ROUNDS_MAX = 4
FILL_MARGIN = 200
"""Grow the logs this many entries past the threshold."""
SETTLE_S = 2.0
"""After the first compaction (`--only compaction`: every replica's), how long to wait
for more lines."""
ACROSS_S = 5.0
"""'Across the compaction': this long before it began to this long after it ended."""
DURING_S = 0.5
"""'During the compaction': this much slack either side of it."""
POLL_S = 0.1


@dataclass
class _Watch:
    """What the phase collected while the compaction happened."""

    phase_t0: float
    filled: int = 0
    fill_done: float = 0.0
    waits: dict[str, float] = field(default_factory=dict)
    done: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    polls: list[tuple[float, str, int, str, int, float]] = field(default_factory=list)
    probes: list[tuple[float, str, float]] = field(default_factory=list)
    acks: list[tuple[float, float, int]] = field(default_factory=list)


def window_wait(b: Bench, tuning: RaftTuning) -> dict[str, float]:
    """Seconds until each replica's compaction window opens (pysyncobj logCompactionSplit).

    pysyncobj lets replica i (by sorted Raft address) compact only during the first
    30% of its 1/N share of every compaction_min_time_s period (time.monotonic()).
    """
    period = tuning.compaction_min_time_s
    addrs = sorted(r.raft_address for r in b.cluster.replicas)
    slot = period / len(addrs)
    now = time.monotonic()
    out = {}
    for r in b.cluster.replicas:
        start = math.floor(now / period) * period + addrs.index(r.raft_address) * slot
        if start <= now < start + 0.3 * slot:
            out[r.replica_id] = 0.0
        else:
            out[r.replica_id] = (start if now < start else start + period) - now
    return out


def fill_log(b: Bench, need: int, leader: Replica) -> int:
    """Commit `need` tiny Publish commands (the same entry re-published)."""
    req = pb.PublishRequest(
        node_id=FILLER_NODE,
        incarnation=b.incarnation,
        namespace=NAMESPACE,
        tier=pb.TIER_GPU,
        block_hashes=[b"\xff" * 8],
        addresses=[0],
        lengths=[1],
        rkeys=[0],
        generations=[1],
    ).SerializeToString()
    procs = b.pool.size
    per = math.ceil(need / procs)
    start_at = time.time() + 0.5
    tasks = [
        CallTask(
            leader.grpc_address,
            PUBLISH,
            "PublishResponse",
            [req] * per,
            start_at,
            0.0,
            per,
            threads=4,
            timeout_s=10.0,
        )
        for _ in range(procs)
    ]
    res = b.pool.run(tasks, timeout_s=max(120.0, need / 200))
    done = sum(r.calls for r in res)
    b.filled += done
    return done


def _fill(b: Bench, threshold: int) -> int:
    filled = 0
    for _ in range(FILL_ROUNDS_MAX):
        short = threshold + FILL_MARGIN - min(s.log_entries for s in b.statuses().values())
        if short <= 0:
            break
        say(f"  committing {short:,} small Publish commands to grow the logs past {threshold:,}")
        filled += fill_log(b, short, b.leader())
    return filled


def _wait_done(
    b: Bench, before: dict[str, int], bound_s: float, replicas: int
) -> dict[str, list[Any]]:
    """The new 'compaction done' lines per replica, once they stopped coming (or once
    `replicas` replicas compacted, then SETTLE_S)."""
    done: dict[str, list[dict[str, Any]]] = {}
    t_done: float | None = None
    for _ in deadline_loop(bound_s, POLL_S, polls_max=int(bound_s / POLL_S) + 1):
        now = time.monotonic()
        done = {k: v[before[k] :] for k, v in logs.compaction_logs(b).items() if len(v) > before[k]}
        if len(done) >= replicas and t_done is None:
            t_done = now
        if t_done is not None and now - t_done > SETTLE_S:
            break
    return done


def _collect(b: Bench, tuning: RaftTuning, watch: _Watch) -> None:
    before = {k: len(v) for k, v in logs.compaction_logs(b).items()}
    bound = 3 * tuning.compaction_min_time_s + 600
    # Watch from the start: with short overrides a compaction may come during the fill.
    status = StatusWatch(b.statuses, max_s=bound)
    addrs = {r.replica_id: r.grpc_address for r in b.cluster.replicas}
    if not b.lookup_reqs:  # the lookup phases did not run (`--only compaction`)
        b.lookup_reqs = [lookup_request(NAMESPACE, b.shape.chain_hashes(0)).SerializeToString()]
    prober = Prober(addrs, b.lookup_reqs[0], max_s=bound)
    w = start_writer(b, max_s=bound)
    status.start()
    prober.start()
    watch.fill_done = time.monotonic()
    try:
        watch.filled = _fill(b, tuning.compaction_min_entries)
        watch.fill_done = time.monotonic()
        watch.waits = window_wait(b, tuning)
        say(
            "  seconds until each replica's compaction window: "
            f"{ {k: round(v, 1) for k, v in watch.waits.items()} }"
        )
        wait_bound = min(watch.waits.values()) + 0.1 * tuning.compaction_min_time_s + 60
        replicas = 1
        if b.cfg.only == "compaction":  # every replica's compaction, the leader's among them
            wait_bound = max(watch.waits.values()) + 0.1 * tuning.compaction_min_time_s + 60
            replicas = len(b.cluster.replicas)
        watch.done = _wait_done(b, before, wait_bound, replicas)
    finally:
        prober.finish()
        status.finish()
        watch.acks = list(w.acks)
        retire_writer(b, w)
    watch.polls, watch.probes = status.polls, prober.samples


def _events(done: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        {
            "replica": rid,
            "entries": rec.get("entries"),
            "capture_s": rec.get("capture_s"),
            "total_s": rec.get("total_s"),
            "done_utc": rec.get("ts"),
            "_end_wall": logs.log_time(rec),
        }
        for rid, recs in done.items()
        for rec in recs
    ]


def _trigger(b: Bench, tuning: RaftTuning, filled: int) -> str:
    overrides = b.cfg.raft_overrides
    return (
        f"raft log grown past compaction_min_entries={tuning.compaction_min_entries:,} with "
        f"{filled:,} one-entry Publish commands (the replicas run "
        + (
            "the product RaftTuning defaults"
            if not overrides
            else f"RaftTuning overrides {overrides} via `serve --tune`"
        )
        + "); pysyncobj then compacts each replica only inside its own window "
        f"(logCompactionSplit: 30% of a {tuning.compaction_min_time_s / 3:.0f} s slot "
        f"every {tuning.compaction_min_time_s:.0f} s)"
    )


def _across(b: Bench, watch: _Watch, c_start: float, c_end: float, offset: float) -> dict[str, Any]:
    """Terms, leaders and role changes from ACROSS_S before to ACROSS_S after."""
    rids = [r.replica_id for r in b.cluster.replicas]
    a_lo, a_hi = max(c_start - ACROSS_S, watch.phase_t0), c_end + ACROSS_S
    near = [p for p in watch.polls if a_lo <= p[0] <= a_hi]
    leaders = sorted({p[3] for p in near})
    near_roles = [e for e in logs.role_changes(b) if a_lo + offset <= e[0] <= a_hi + offset]
    last_comp: dict[str, float] = {}
    for p in watch.polls:
        last_comp[p[1]] = p[5]
    return {
        "last_compaction_s_reported": last_comp,
        "terms_seen": {rid: sorted({p[2] for p in near if p[1] == rid}) for rid in rids},
        "leaders_seen": leaders,
        "status_polls": len(near),
        "polled_replicas": sorted({p[1] for p in near}),
        "role_changes_across": len(near_roles),
        "no_election": (
            len({p[2] for p in near}) == 1
            and len(leaders) == 1
            and not near_roles
            and len({p[1] for p in near}) == len(rids)
        ),
        "across_window": f"from {ACROSS_S:.0f} s before the first compaction listed began (or "
        f"the phase start, if later) to {ACROSS_S:.0f} s after the last one's dump was written",
        "terms_seen_whole_phase": {
            rid: sorted({p[2] for p in watch.polls if p[1] == rid}) for rid in rids
        },
    }


def _stalls(b: Bench, lo_wall: float, hi_wall: float) -> dict[str, Any]:
    """Each replica's 'raft thread stalled' lines between two wall times."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in b.cluster.replicas:
        lines = [x for x in logs.read_log(r.log_path) if x.get("msg") == "raft thread stalled"]
        out[r.replica_id] = [
            {k: x.get(k) for k in ("ts", "gap_ms", "fdatasync_ms", "role")}
            for x in lines
            if lo_wall <= logs.log_time(x) <= hi_wall
        ]
    longest = {
        rid: max(v, key=lambda x: float(x["gap_ms"] or 0), default=None) for rid, v in out.items()
    }
    return {
        "raft_stalls_across": out,
        "raft_stall_longest_across": {
            rid: None if x is None else {"gap_ms": x["gap_ms"], "fdatasync_ms": x["fdatasync_ms"]}
            for rid, x in longest.items()
        },
        "raft_stall_gap_ms_max_across": max(
            (float(x["gap_ms"] or 0) for v in out.values() for x in v), default=0.0
        ),
    }


def _during(b: Bench, watch: _Watch, c_start: float, c_end: float) -> dict[str, Any]:
    """The writer's and the prober's slowest calls from DURING_S before to DURING_S after."""
    lo, hi = c_start - DURING_S, c_end + DURING_S
    write_lat = [t - s for s, t, _ in watch.acks if lo <= s <= hi]
    probe = {
        r.replica_id: max(
            (lat for t, rid, lat in watch.probes if rid == r.replica_id and lo <= t <= hi),
            default=math.nan,
        )
        for r in b.cluster.replicas
    }
    return {
        "writes_during": len(write_lat),
        "write_latency_max_ms_during": max(write_lat) * 1e3 if write_lat else math.nan,
        "lookup_latency_max_ms_during": {k: v * 1e3 for k, v in probe.items()},
        "during_window": f"from {DURING_S} s before the first compaction listed began to "
        f"{DURING_S} s after the last one's dump was written",
    }


def run(b: Bench) -> None:
    tuning = b.cfg.tuning
    watch = _Watch(phase_t0=time.monotonic())
    log_len = {k: s.log_entries for k, s in b.statuses().items()}
    say(
        f"compaction: raft log lengths {log_len}; "
        f"compaction_min_entries {tuning.compaction_min_entries}"
    )
    _collect(b, tuning, watch)
    if not watch.done:
        b.results["compaction"] = {
            "error": "no compaction within the wait bound",
            "log_lengths": log_len,
        }
        raise RuntimeError(b.results["compaction"]["error"])
    events = _events(watch.done)
    first = min(events, key=lambda e: e["_end_wall"])
    # Map the compactions' wall-clock span onto time.monotonic() for the samples.
    offset = time.time() - time.monotonic()
    c_end = max(e["_end_wall"] for e in events) - offset
    c_start = min(e["_end_wall"] - float(e["total_s"] or 0) for e in events) - offset
    for e in events:
        del e["_end_wall"]
    b.results["compaction"] = {
        "trigger": _trigger(b, tuning, watch.filled),
        "compaction_min_entries": tuning.compaction_min_entries,
        "compaction_min_time_s": tuning.compaction_min_time_s,
        "filler_commands": watch.filled,
        "log_lengths_before": log_len,
        "window_wait_s": min(watch.waits.values()),
        "began_after_fill_s": c_start - watch.fill_done,
        "events": events,
        "entries": first["entries"],
        "capture_s": first["capture_s"],
        "total_s": first["total_s"],
        **_across(b, watch, c_start, c_end, offset),
        **_stalls(b, max(c_start - ACROSS_S, watch.phase_t0) + offset, c_end + ACROSS_S + offset),
        **_during(b, watch, c_start, c_end),
    }
    say(
        f"  {first['replica']} compacted {first['entries']:,} entries: capture "
        f"{first['capture_s']}s, total {first['total_s']}s; "
        f"terms {b.results['compaction']['terms_seen']}; longest Raft tick gap per replica "
        f"(ms, of which fdatasync) {b.results['compaction']['raft_stall_longest_across']}"
    )
