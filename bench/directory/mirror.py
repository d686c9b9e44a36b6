"""Phase: an in-process mirror of the loaded directory: start, lookups, lag under publishes.

A `Mirror` fed by a Watch stream from the follower the lookup phase measured
(so its lookups sit next to that phase's Lookup and Echo in the same run):

1. start: the snapshot of the whole table over Watch until the mirror is fresh;
2. lookups: the lookup phase's query chains answered in process, records
   included (the RPC's own message), one thread (one core), and the routing
   form (`holders`: prefix lengths only, no message);
3. lag: publishes of new blocks offered at `LAG_ENTRIES_PER_S` through the
   leader from the bench's client processes; per acknowledged publish, from
   its acknowledgement until the mirror's applied index reached its index
   (negative: the mirror had it first). The same at the lower rates of
   `LAG_SWEEP_ENTRIES_PER_S` first, each with the machine's CPU use, so the
   report shows where on this host the lag leaves the target and why.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from bench import host
from bench import targets as tg
from bench.directory.cluster import FILLER_NODE, NAMESPACE, PUBLISH, Bench, merge_errors
from bench.markdown import Section, Table, Text
from bench.measure import ms_stats_from_ns, say
from bench.workers import CallTask
from kvdir.core.gc_freeze import freeze_startup
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.wire import namespace_key
from kvdir.directory.lookup import Chain
from kvdir.v1 import directory_pb2 as pb

START_TIMEOUT_S = 600.0
LAG_ENTRIES_PER_S = 100_000
LAG_SWEEP_ENTRIES_PER_S = (25_000, 50_000)
"""Lower offered rates measured before the target's (info rows, not goals)."""
LAG_BATCH_ENTRIES = 1000
LAG_SENDER_PROCS = 2
LAG_THREADS_PER_PROC = 4
"""Publishes in flight at most: procs x threads (each thread waits for its answer)."""
LAG_DURATION_S = 8.0
POLL_S = 0.0005
"""How often the lag phase samples the mirror's applied index."""


def start(b: Bench, address: str) -> tuple[Mirror, MirrorSync, float]:
    # This process is the mirror's host here, as a gateway or an agent is in
    # production, and those freeze their start-up objects (kvdir/core/gc_freeze.py):
    # so the bench's own prepared data is kept out of the collector's walks too.
    freeze_startup("bench")
    m = Mirror(max_staleness_s=5.0)
    t0 = time.perf_counter()
    sync = MirrorSync(m, [address]).start()
    leader = b.leader()
    target = b.stubs.status(leader.grpc_address, 5.0)
    need = target.commit_index if target is not None else 1
    deadline = t0 + START_TIMEOUT_S
    while not (m.fresh() and m.applied_index >= need):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the mirror did not start in {START_TIMEOUT_S:.0f}s: {m.error}")
        time.sleep(0.05)
    return m, sync, time.perf_counter() - t0


def lookups(b: Bench, m: Mirror) -> dict[str, Any]:
    reqs = [pb.LookupRequest.FromString(r) for r in b.lookup_reqs]
    s = b.shape
    wrong = 0
    for c, req in zip(b.queries, reqs, strict=True):
        got = sorted((x.node_id, x.prefix_blocks) for x in m.lookup_message(req).matches)
        wrong += got != sorted((s.node_id(h), s.chain_blocks) for h in s.holders(c))
    out: dict[str, Any] = {"wrong_answers": wrong, "chain_blocks": s.chain_blocks}
    key = namespace_key(NAMESPACE)
    chains = [Chain(r.packed_hashes, r.hash_width) for r in reqs]
    for name, call in (
        ("message", lambda i: m.lookup_message(reqs[i])),
        ("holders", lambda i: m.holders(key, chains[i], 8)),
    ):
        lat: list[int] = []
        t_end = time.perf_counter() + b.cfg.duration_s / 2
        t0, c0 = time.perf_counter(), time.thread_time()
        i = 0
        while time.perf_counter() < t_end:
            a = time.perf_counter_ns()
            call(i % len(reqs))
            lat.append(time.perf_counter_ns() - a)
            i += 1
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        out[name] = {
            **ms_stats_from_ns(lat),
            "chains_per_s": i / wall,
            "chains_per_cpu_s": i / cpu if cpu > 0 else 0.0,
            "n": i,
        }
    return out


def lag_requests(b: Bench, rate: int) -> list[bytes]:
    """The lag phase's publishes at `rate` entries/s, built before it starts: new
    8-byte blocks (the product's width), one filler-node batch each."""
    rng = random.Random(b.cfg.seed * 7919 + 17 + rate)
    n = LAG_BATCH_ENTRIES
    count = round(rate * LAG_DURATION_S / n)
    return [
        pb.PublishRequest(
            node_id=FILLER_NODE,
            incarnation=b.incarnation,
            namespace=NAMESPACE,
            tier=pb.TIER_GPU,
            block_hashes=[rng.randbytes(8) for _ in range(n)],
            addresses=[0x10_0000 + 4096 * j for j in range(n)],
            lengths=[4096] * n,
            rkeys=[7] * n,
            generations=[1] * n,
        ).SerializeToString()
        for _ in range(count)
    ]


def lag(b: Bench, m: Mirror, rate: int = LAG_ENTRIES_PER_S) -> dict[str, Any]:
    """Publishes offered at `rate` entries/s; per ack, how long until the mirror had it.

    The publishers are the bench's client processes (as agents on other nodes
    would be), so this process holds only the mirror and the sampler of its
    applied index; the ack times and the sampler's share the monotonic clock."""
    reqs = lag_requests(b, rate)
    # What faulting in a fresh page costs on this host right now (before the window,
    # so the probe's own faults are not in it): the table grows by ~4,000 pages a
    # second per process at the target rate.
    touch_us = host.first_touch_us_per_page()
    procs = max(1, min(b.pool.size, LAG_SENDER_PROCS))
    interval = LAG_BATCH_ENTRIES / rate
    start_at = time.time() + 1.0
    tasks = [
        CallTask(
            b.leader().grpc_address,
            PUBLISH,
            "PublishResponse",
            reqs[w::procs],
            start_at + w * interval,
            0.0,
            len(reqs),
            threads=LAG_THREADS_PER_PROC,
            timeout_s=10.0,
            sum_field="applied",
            pace_s=interval * procs,
            stamp_field="applied_index",
        )
        for w in range(procs)
    ]
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        last = -1
        while not stop.is_set():
            at = m.applied_index
            if at != last:
                seen.append((at, time.perf_counter_ns()))
                last = at
            stop.wait(POLL_S)

    w = threading.Thread(target=sample, daemon=True)
    w.start()
    busy0, total0, _ = b.cpu.totals()
    kernel0 = host.machine_kernel_cpu()
    term0 = _max_term(b)
    try:
        res = b.pool.run(tasks, timeout_s=LAG_DURATION_S + 120)
        acks = sorted(x for r in res for x in r.stamps)
        final = max((i for i, _ in acks), default=0)
        deadline = time.perf_counter() + 20.0
        while m.applied_index < final and time.perf_counter() < deadline:
            stop.wait(0.01)  # the sampler records when; this only bounds the phase
    finally:
        stop.set()
        w.join(5)
    busy1, total1, _ = b.cpu.totals()
    kernel1 = host.machine_kernel_cpu()
    term1 = _max_term(b)
    window = max(r.finished for r in res) - min(r.started for r in res)
    lags = [_first_seen(seen, idx) - t for idx, t in acks]
    return {
        "target_entries_per_s": rate,
        "machine_cpu_busy": (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0,
        "machine_cpu_system": host.busy_share(kernel0, kernel1),
        "first_touch_us_per_page": touch_us,
        "terms_started": term1 - term0,  # > 0: an election (a stall of the publishes)
        "achieved_entries_per_s": sum(r.summed for r in res) / window if window > 0 else 0.0,
        "publishes": len(acks),
        "publish_errors": merge_errors(res),
        "publishes_failed": sum(r.failed for r in res),
        "batch_entries": LAG_BATCH_ENTRIES,
        "senders": f"{procs} client processes x {LAG_THREADS_PER_PROC} threads, paced",
        "lag_ms": ms_stats_from_ns(lags),
        "lag_ms_max": max(lags) / 1e6 if lags else 0.0,
        "never_seen": sum(idx > m.applied_index for idx, _ in acks),
    }


def _max_term(b: Bench) -> int:
    """The highest Raft term any replica reports (it grows by one per election started)."""
    return max((st.term for st in b.statuses().values()), default=0)


def _first_seen(seen: list[tuple[int, int]], index: int) -> int:
    for at, t in seen:
        if at >= index:
            return t
    return seen[-1][1] if seen else 0


def run(b: Bench) -> None:
    target = b.target or b.follower()
    say(f"mirror of follower {target.replica_id}")
    m, sync, start_s = start(b, target.grpc_address)
    say(f"  started in {start_s:.1f}s at index {m.applied_index} ({m.table.entries} entries)")
    try:
        lk = lookups(b, m)
        say(
            f"  mirror lookup p50 {lk['message']['p50_ms']:.4f} ms, "
            f"{lk['message']['chains_per_s']:.0f} chains/s (routing form "
            f"{lk['holders']['chains_per_s']:.0f}/s)"
        )
        sweep = []
        lower = () if b.cfg.quick else LAG_SWEEP_ENTRIES_PER_S  # a smoke run: the target only
        for rate in (*lower, LAG_ENTRIES_PER_S):
            lg = lag(b, m, rate)
            say(
                f"  lag p99 {lg['lag_ms']['p99_ms']:.1f} ms at "
                f"{lg['achieved_entries_per_s']:.0f} entries/s (offered {rate:,}), "
                f"machine CPU busy {lg['machine_cpu_busy']:.2f}, elections {lg['terms_started']}"
            )
            sweep.append(lg)
    finally:
        sync.stop()
    b.results["mirror"] = {
        "replica": target.replica_id,
        "start_s": start_s,
        "entries": m.table.entries,
        "lookups": lk,
        "lag": lg,
        "lag_sweep": sweep,
        "snapshots": m.snapshots,
    }


# ------------------------------------------------------------------ report

GOALS = (
    tg.Goal(
        "mirror_p50",
        "Mirror lookup p50, full message, 500-block chain (in process)",
        ("mirror", "lookups", "message", "p50_ms"),
        "<=",
        0.1,
        "ms",
    ),
    tg.Goal(
        "mirror_rate",
        "Mirror full-message lookups per CPU-second, one thread",
        ("mirror", "lookups", "message", "chains_per_cpu_s"),
        ">=",
        10_000,
        "/s",
    ),
    tg.Goal(
        "mirror_route_rate",
        "Mirror routing-form lookups per CPU-second, one thread",
        ("mirror", "lookups", "holders", "chains_per_cpu_s"),
        "info",
        unit="/s",
    ),
    tg.Goal(
        "mirror_lag_p99",
        "Mirror lag p99 after the leader's ack, under the publish load below",
        ("mirror", "lag", "lag_ms", "p99_ms"),
        "<=",
        50,
        "ms",
    ),
    tg.Goal(
        "mirror_lag_load",
        f"Publish load during the lag phase (offered {LAG_ENTRIES_PER_S:,} entries/s)",
        ("mirror", "lag", "achieved_entries_per_s"),
        "info",
        unit="/s",
    ),
)


def context(r: dict[str, Any]) -> dict[str, Any]:
    mi = r.get("mirror")
    if not mi:
        return {}
    forms = {"message": "full message (the Lookup RPC's)", "holders": "routing (holders)"}
    rows = [{"form": label, "x": mi["lookups"][k]} for k, label in forms.items()]
    sweep = mi.get("lag_sweep") or [mi["lag"]]
    return {"mi": mi, "mirror_rows": rows, "lag_rows": sweep}


SECTION = Section(
    "mi",
    "In-process mirror (a Watch of replica {mi[replica]})",
    (
        Text(
            "Started from the Watch snapshot in {mi[start_s]} s with {mi[entries]:,} entries "
            "({mi[snapshots]} snapshot). Lookups: the lookup phase's query chains, one thread, "
            "next to that phase's RPC Lookup above; 'per CPU-s' is calls per second of the "
            "thread's own CPU time (one core), the wall-clock rate is what the thread got on "
            "the shared host. Wrong answers: {mi[lookups][wrong_answers]}."
        ),
        Table(
            ("form", "p50 ms", "p99 ms", "chains/s (wall)", "chains per CPU-s"),
            (
                "{form}",
                "{x[p50_ms]}",
                "{x[p99_ms]}",
                "{x[chains_per_s]:,.0f}",
                "{x[chains_per_cpu_s]:,.0f}",
            ),
            "mirror_rows",
        ),
        Text(
            "Lag: {mi[lag][publishes]:,} publishes of {mi[lag][batch_entries]:,} new blocks "
            "offered at {mi[lag][target_entries_per_s]:,} entries/s through the leader "
            "({mi[lag][senders]}), "
            "{mi[lag][achieved_entries_per_s]:,.0f} entries/s committed; from each ack to the "
            "mirror's applied index reaching it: p50 {mi[lag][lag_ms][p50_ms]} ms, p99 "
            "{mi[lag][lag_ms][p99_ms]} ms, max {mi[lag][lag_ms_max]} ms. Failed publishes "
            "{mi[lag][publishes_failed]}; acks the mirror never reached {mi[lag][never_seen]}. "
            "The same at lower offered rates (the last row is the one above); 'CPU busy' is "
            "the whole machine's share during the rate's window and 'in kernel' the part of "
            "it in system mode, 'fresh page' what faulting in one new page cost just before "
            "the window (bench/host.py: ~1.5-2 us on a host whose memory is backed; in a VM "
            "whose host backs or reclaims guest pages lazily, every page a growing table "
            "touches costs that much more, in every replica and in the mirror), "
            "'elections' the Raft terms started in it (each one stalls the publishes):"
        ),
        Table(
            (
                "offered entries/s",
                "committed entries/s",
                "lag p50 ms",
                "lag p99 ms",
                "lag max ms",
                "machine CPU busy",
                "in kernel",
                "fresh page us",
                "elections",
                "failed",
            ),
            (
                "{target_entries_per_s:,}",
                "{achieved_entries_per_s:,.0f}",
                "{lag_ms[p50_ms]}",
                "{lag_ms[p99_ms]}",
                "{lag_ms_max}",
                "{machine_cpu_busy:.2f}",
                "{machine_cpu_system:.2f}",
                "{first_touch_us_per_page:.2f}",
                "{terms_started}",
                "{publishes_failed}",
            ),
            "lag_rows",
        ),
    ),
)
