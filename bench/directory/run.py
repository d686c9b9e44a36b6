"""`kvdir bench directory`'s entry: the phase registry, the run, the output files."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.directory import (
    batch,
    compaction,
    durability,
    evidence,
    failover,
    logs,
    lookups,
    memory,
    mirror,
    publish,
    shards,
    verify,
)
from bench.directory import report as directory_report
from bench.directory.cluster import Bench, make_cluster
from bench.directory.config import ONLY, Config, resolve
from bench.host import load_average
from bench.measure import say
from bench.workers import WorkerPool
from kvdir import report


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    """The phase's row in 'Host load per phase' (and the phase an election falls in)."""
    run: Callable[[Bench], None]


PHASES: tuple[Phase, ...] = (
    Phase("publish load", publish.run),
    Phase("lookups", lookups.run),
    Phase("lookup batch", batch.run),
    Phase("mirror", mirror.run),
    Phase("leader kills", failover.run),
    Phase("compaction", compaction.run),
    Phase("verification", verify.run),
    Phase("durability", durability.run),
)
"""The phases against the cluster, in order; each writes its own key of `Bench.results`.
A later phase may use what an earlier one left on `Bench` (the query chains, the
writer's acknowledged batches)."""


def timed(b: Bench, phase: Phase) -> None:
    """Run one phase, noting its wall-clock span, load average and foreign CPU use."""
    b0, t0, o0 = b.cpu.totals()
    rec: dict[str, Any] = {
        "phase": phase.name,
        "start_wall": time.time(),
        "loadavg_start": load_average(),
    }
    b.phases.append(rec)
    try:
        phase.run(b)
    finally:
        b1, t1, o1 = b.cpu.totals()
        rec["end_wall"] = time.time()
        rec["wall_s"] = rec["end_wall"] - rec["start_wall"]
        rec["loadavg_end"] = load_average()
        rec["machine_cpu_busy"] = (b1 - b0) / (t1 - t0) if t1 > t0 else math.nan
        rec["foreign_cpu_share"] = (
            max(0.0, (b1 - b0) - (o1 - o0)) / (t1 - t0) if t1 > t0 else math.nan
        )


def run_phases(b: Bench) -> None:
    hb = publish.register(b)
    try:
        for phase in PHASES:
            if b.cfg.only is None or phase.name in ONLY[b.cfg.only]:
                timed(b, phase)
        b.results["memory"]["replicas"]["rss_bytes_end"] = b.rss()
    finally:
        hb.stop_ev.set()
        hb.join(timeout=10)
        b.results.setdefault("misc", {})["heartbeat_errors"] = hb.errors


def finish(b: Bench) -> None:
    """What the replica logs say, once the phases are over (also after a failure)."""
    b.close()
    b.results["replica_logs"] = logs.log_summary(b)
    b.results["phases"] = b.phases
    b.results["elections"] = logs.classify_elections(b)


def measure_all(cfg: Config, base: str, results: dict[str, Any]) -> None:
    with WorkerPool(cfg.clients) as pool:
        cluster = make_cluster(base, cfg)
        b = Bench(cfg, cluster, pool)
        try:
            cluster.start(timeout_s=60)
            run_phases(b)
        finally:
            finish(b)
            results.update(b.results)
            cluster.stop()
    memory.run(results, cfg.memory_entries, cfg.skip_memory)


def config_record(cfg: Config) -> dict[str, Any]:
    return {
        "entries": cfg.entries,
        "memory_entries": cfg.memory_entries,
        "kills": cfg.kills,
        "duration_s": cfg.duration_s,
        "clients": cfg.clients,
        "batch_chains": cfg.batch_chains,
        "publish_batch": cfg.publish_batch,
        "publish_inflight": cfg.publish_inflight,
        "raft_overrides": cfg.raft_overrides,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "skip_memory": cfg.skip_memory,
        "only": cfg.only,
    }


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    if cfg.shards:
        return evidence.run(cfg) if cfg.evidence else shards.run(cfg)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    data: dict[str, Any] = {"header": report.header(started), "config": config_record(cfg)}
    data["results"] = results
    tmp = None if cfg.data_dir else tempfile.mkdtemp(prefix="kvdir-bench-")
    base = cfg.data_dir or tmp
    assert base is not None
    say(f"replica data and logs under {base}")
    try:
        measure_all(cfg, base, results)
    except Exception as e:
        data["error"] = traceback.format_exc()
        say(f"benchmark failed: {e!r}; replica logs kept under {base}")
    data["header"]["wall_s"] = time.monotonic() - t0
    data["header"]["source_fingerprint_end"] = report.source_fingerprint()
    data["targets"] = [t.as_dict() for t in directory_report.targets(results)]
    md = directory_report.markdown(data)
    stem = "directory" if cfg.only is None else f"directory-{cfg.only}"
    md_path, js_path = report.write(cfg.out_dir, f"{stem}-{started:%Y-%m-%d}", md, data)
    print(md)
    say(f"wrote {md_path} and {js_path}")
    if tmp is not None and "error" not in data:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if "error" in data else 0
