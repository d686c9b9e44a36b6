"""Phase: what the durable journal costs - publish throughput and leader-kill gap, both modes.

Each mode (`power-loss`, the default, which fdatasyncs the Raft log before
acknowledging; `process-crash`, which does not) gets fresh 3-replica clusters
of its own, started one at a time on the same machine, in the order A B B A B A A B
so that drift in the machine's load hits both modes alike; rates are
compared as medians over each mode's runs. On each:

- small publishes: `SMALL_RPCS` Publish RPCs of 16 fresh entries (the shape of
  an agent's incremental publishes), `SMALL_INFLIGHT` in flight to the leader,
  where a per-write fsync would show most;
- bulk publishes: `BULK_RPCS` RPCs of 1,024 entries, `BULK_INFLIGHT` in flight;
- one writer, one RPC in flight: latency of a 16-entry publish;
- on the first cluster of each mode, `--kills` leader SIGKILLs under the
  failover phase's writer (`failover.run` on this cluster): the write gap.

The replicas' own group-commit counters (the journal's "journal sync stats"
log lines: fdatasyncs, entries per fdatasync) say how well batching worked.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

from bench import targets as tg
from bench.directory import failover, logs
from bench.directory.cluster import LEASE_MS, NAMESPACE, PUBLISH, Bench, merge_errors
from bench.directory.threads import WRITER_NODE
from bench.markdown import Section, Table, Text
from bench.measure import ms_stats_from_ns, say
from bench.shape import writer_hashes
from bench.workers import CallTask
from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

MODES = ("power-loss", "process-crash")
ORDER = (0, 1, 1, 0, 1, 0, 0, 1)
"""Mode of each cluster run (A B B A B A A B): drift in the machine's load hits both alike."""
QUICK_ORDER = (0, 1)
"""--quick: one cluster per mode, a tenth of the RPCs, no kills (a smoke run)."""
QUICK_SHARE = 10
NODE = "bench-durability"
SMALL_BATCH = 16
SMALL_RPCS = 3000
SMALL_INFLIGHT = 16
BULK_BATCH = 1024
BULK_RPCS = 120
BULK_INFLIGHT = 8
SERIAL_RPCS = 400
RUN_TIMEOUT_S = 600.0
SEQ_STRIDE = 1 << 40
"""Each cluster run's writes use their own block numbers (fresh entries every time)."""


def _cluster(b: Bench, run: int, mode: str) -> LocalCluster:
    base = os.path.join(b.cluster.base_dir, f"durability-{run}-{mode}")
    extra = [a for k, v in b.cfg.raft_overrides.items() for a in ("--tune", f"{k}={v}")]
    return LocalCluster(base, size=3, extra_args=[*extra, "--durability", mode])


def _requests(first: int, rpcs: int, batch: int, incarnation: int) -> list[bytes]:
    out = []
    for i in range(rpcs):
        seq = first + i
        out.append(
            pb.PublishRequest(
                node_id=NODE,
                incarnation=incarnation,
                namespace=NAMESPACE,
                tier=pb.TIER_GPU,
                block_hashes=writer_hashes(seq, batch),
                addresses=[(i * batch + k) * 65536 for k in range(batch)],
                lengths=[65536] * batch,
                rkeys=[7] * batch,
                generations=[1] * batch,
            ).SerializeToString()
        )
    return out


def _publish(b: Bench, c: LocalCluster, reqs: list[bytes], inflight: int) -> dict[str, Any]:
    """Send every request once, `inflight` at a time, to the leader; entries/s and latency."""
    leader = c.wait_leader(30.0)
    procs = max(1, min(b.pool.size, inflight))
    threads = math.ceil(inflight / procs)
    start_at = time.time() + 1.0
    tasks = [
        CallTask(leader.grpc_address, PUBLISH, "PublishResponse", reqs[w::procs], start_at, 0.0,
                 len(reqs), threads=threads, timeout_s=30.0, sum_field="applied")
        for w in range(procs)
    ]  # fmt: skip
    res = b.pool.run(tasks, timeout_s=RUN_TIMEOUT_S)
    window = max(r.finished for r in res) - min(r.started for r in res)
    applied = sum(r.summed for r in res)
    return {
        "rpcs": len(reqs),
        "inflight": procs * threads,
        "entries_applied": applied,
        "wall_s": window,
        "entries_per_s": applied / window if window > 0 else math.nan,
        "rpcs_per_s": sum(r.calls for r in res) / window if window > 0 else math.nan,
        "rpc_latency": ms_stats_from_ns([x for r in res for x in r.latencies_ns]),
        "failed": sum(r.failed for r in res),
        "errors": merge_errors(res),
    }


def _register(c: LocalCluster, incarnation: int) -> None:
    with DirectoryClient(c.grpc_addresses, timeout_s=10.0) as client:
        for node in (NODE, WRITER_NODE):
            client.register_node(node, "127.0.0.1", incarnation, "127.0.0.1:9999", ["tcp"],
                                 lease_ms=LEASE_MS)  # fmt: skip


def sync_stats(c: LocalCluster) -> dict[str, Any]:
    """Each replica's last group-commit counters, from its log."""
    out: dict[str, Any] = {}
    for r in c.replicas:
        lines = [x for x in logs.read_log(r.log_path) if x.get("msg") == "journal sync stats"]
        if lines:
            last = lines[-1]
            syncs, entries = last["journal_syncs"], last["journal_entries"]
            out[r.replica_id] = {
                "syncs": syncs,
                "entries": entries,
                "entries_per_sync": entries / syncs if syncs else math.nan,
                "largest_batch": last["journal_largest_batch"],
                "sync_ms_mean": 1e3 * last["journal_sync_s"] / syncs if syncs else math.nan,
                "batch_sizes": last["journal_batch_sizes"],
            }
    return out


def _one_run(b: Bench, run: int, mode: str, kills: bool) -> dict[str, Any]:
    c = _cluster(b, run, mode)
    rec: dict[str, Any] = {"run": run, "mode": mode}
    share = QUICK_SHARE if b.cfg.quick else 1
    small, bulk, serial = SMALL_RPCS // share, BULK_RPCS // share, SERIAL_RPCS // share
    try:
        c.start(timeout_s=60)
        incarnation = time.time_ns()
        _register(c, incarnation)
        first = (run + 1) * SEQ_STRIDE
        rec["small"] = _publish(b, c, _requests(first, small, SMALL_BATCH, incarnation),
                                SMALL_INFLIGHT)  # fmt: skip
        first += small
        rec["bulk"] = _publish(b, c, _requests(first, bulk, BULK_BATCH, incarnation),
                               BULK_INFLIGHT)  # fmt: skip
        first += bulk
        rec["serial"] = _publish(b, c, _requests(first, serial, SMALL_BATCH, incarnation), 1)
        if kills:
            rec["failover"] = _kills(b, c, incarnation)
        say(
            f"durability run {run} ({mode}): small {fmt(rec['small']['entries_per_s'])} "
            f"entries/s, bulk {fmt(rec['bulk']['entries_per_s'])} entries/s, serial p50 "
            f"{rec['serial']['rpc_latency']['p50_ms']:.2f} ms"
        )
    finally:
        c.stop()
        rec["sync_stats"] = sync_stats(c)
    return rec


def _kills(b: Bench, c: LocalCluster, incarnation: int) -> dict[str, Any]:
    """The failover phase, run against this cluster (its own Bench view of it)."""
    sub = Bench(b.cfg, c, b.pool)
    sub.incarnation = incarnation
    try:
        failover.run(sub)
    finally:
        sub.close()
    fo: dict[str, Any] = sub.results["failover"]
    return {k: fo[k] for k in ("gaps_s", "gap_median_s", "gap_max_s", "election_median_s")}


def _median(runs: list[dict[str, Any]], mode: str, workload: str) -> float:
    xs = [r[workload]["entries_per_s"] for r in runs if r["mode"] == mode]
    return statistics.median(xs) if xs else math.nan


def summary(runs: list[dict[str, Any]], order: tuple[int, ...] = ORDER) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs, "order": [MODES[i] for i in order]}
    for workload in ("small", "bulk", "serial"):
        durable, fast = _median(runs, MODES[0], workload), _median(runs, MODES[1], workload)
        out[workload] = {
            "durable_entries_per_s": durable,
            "process_crash_entries_per_s": fast,
            "ratio": durable / fast if fast else math.nan,
        }
    for mode in MODES:
        fo = next((r["failover"] for r in runs if r["mode"] == mode and "failover" in r), None)
        out[f"gap_median_s_{mode}"] = fo["gap_median_s"] if fo else math.nan
    return out


def run(b: Bench) -> None:
    runs = []
    seen: set[str] = set()
    order = QUICK_ORDER if b.cfg.quick else ORDER
    for run_no, i in enumerate(order):
        mode = MODES[i]
        kills = mode not in seen and b.cfg.kills > 0 and not b.cfg.quick
        runs.append(_one_run(b, run_no, mode, kills))
        seen.add(mode)
    b.results["durability"] = summary(runs, order)


# ------------------------------------------------------------------ report

GOALS = (
    tg.Goal(
        "durable_small_ratio",
        "Durable / process-crash publish rate, 16-entry RPCs, 16 in flight",
        ("durability", "small", "ratio"),
        ">=",
        0.7,
        "x",
    ),
    tg.Goal(
        "durable_bulk_ratio",
        "Durable / process-crash publish rate, 1,024-entry RPCs",
        ("durability", "bulk", "ratio"),
        ">=",
        0.7,
        "x",
    ),
    tg.Goal(
        "durable_gap_median",
        "Leader-kill write gap median, durable journal",
        ("durability", "gap_median_s_power-loss"),
        "<=",
        0.3,
        "s",
    ),
)


def context(r: dict[str, Any]) -> dict[str, Any]:
    d = r.get("durability")
    if not d:
        return {}
    rows = []
    for x in d["runs"]:
        st = x.get("sync_stats", {})
        per_sync = [v["entries_per_sync"] for v in st.values()]
        rows.append(
            {
                "x": x,
                "gap": fmt(x["failover"]["gap_median_s"]) if "failover" in x else "-",
                "per_sync": " / ".join(f"{v:.1f}" for v in per_sync) or "-",
                "syncs": " / ".join(str(v["syncs"]) for v in st.values()) or "-",
            }
        )
    return {"du": d, "durability_rows": rows}


SECTION = Section(
    "du",
    "Durable journal vs process-crash mode",
    (
        Text(
            "Fresh 3-replica clusters per mode, run one at a time in the order "
            "{du[order]:slash}. Ratios: median durable rate / median process-crash rate. "
            "Small {du[small][ratio]:x}, bulk {du[bulk][ratio]:x}, serial {du[serial][ratio]:x}; "
            "leader-kill gap median {du[gap_median_s_power-loss]} s durable, "
            "{du[gap_median_s_process-crash]} s process-crash."
        ),
        Table(
            (
                "run",
                "mode",
                "small entries/s",
                "bulk entries/s",
                "serial p50 ms",
                "kill gap median s",
                "entries per fdatasync (r1/r2/r3)",
                "fdatasyncs",
            ),
            (
                "{x[run]}",
                "{x[mode]}",
                "{x[small][entries_per_s]}",
                "{x[bulk][entries_per_s]}",
                "{x[serial][rpc_latency][p50_ms]}",
                "{gap}",
                "{per_sync}",
                "{syncs}",
            ),
            "durability_rows",
        ),
    ),
)


def markdown(data: dict[str, Any]) -> str:
    """This phase's own report (`main`): the machine header, its targets, its section."""
    from bench.markdown import Raw, render
    from kvdir import report

    ctx = {
        **context(data["results"]),
        "h": data["header"],
        "header_md": report.header_markdown(data["header"]),
        "targets_md": report.targets_table([tg.from_dict(t) for t in data["targets"]]),
    }
    sections = (
        Section("header_md", None, (Raw("header_md"),)),
        Section("targets_md", "Targets", (Raw("targets_md"),)),
        SECTION,
    )
    return render(
        "# kvdir directory benchmark, durability phase, {h[started_utc]:.10}", sections, ctx
    )


def main(argv: list[str] | None = None) -> int:
    """This phase alone: `python -m bench.directory.durability [kvdir bench directory flags]`."""
    import argparse
    import datetime as dt
    import tempfile

    from bench.directory.config import add_arguments, resolve
    from bench.workers import WorkerPool
    from kvdir import report

    ap = argparse.ArgumentParser(prog="python -m bench.directory.durability")
    add_arguments(ap)
    cfg = resolve(ap.parse_args(argv))
    started = dt.datetime.now(dt.UTC)
    base = cfg.data_dir or tempfile.mkdtemp(prefix="kvdir-bench-durability-")
    with WorkerPool(cfg.clients) as pool:
        b = Bench(cfg, LocalCluster(base, size=0), pool)
        try:
            run(b)
        finally:
            b.close()
    data: dict[str, Any] = {"header": report.header(started), "results": b.results}
    data["targets"] = [t.as_dict() for t in tg.check_all(GOALS, b.results)]
    md = markdown(data)
    paths = report.write(cfg.out_dir, f"directory-durability-{started:%Y-%m-%d}", md, data)
    print(md)
    say(f"wrote {paths[0]} and {paths[1]}")
    return 0


__all__ = ["GOALS", "SECTION", "context", "main", "markdown", "run", "summary", "sync_stats"]


if __name__ == "__main__":
    raise SystemExit(main())
