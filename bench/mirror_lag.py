"""The mirror's lag at a chosen table size: the directory bench's lag phase after a preload.

Run as ``python -m bench.mirror_lag --preload N``. The directory bench's
3-replica LocalCluster and nodes; `--preload` new blocks published through
the leader as fast as it takes them; then a Mirror of a follower, started
from its Watch snapshot, and `--repeat` runs of `kvdir bench directory`'s lag
phase (bench/directory/mirror.py: publishes of 1,000 new blocks offered at
`--rate` entries/s from the client processes; per acknowledged publish, the
time until the mirror's applied index reached it). Prints one JSON object.

Why a table size: some costs show only in a window of sizes (the block
index's grows, directory/block_index.py), and the full bench's lag phase runs
at whatever size its earlier phases left.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.directory import config, mirror, publish
from bench.directory.cluster import Bench, make_cluster, merge_errors
from bench.measure import say
from bench.workers import WorkerPool

PRELOAD_THREADS = 4
PRELOAD_TIMEOUT_S = 900.0


def preload(b: Bench, entries: int) -> dict[str, Any]:
    """`entries` new blocks (filler-node publishes of 1,000) through the leader, unpaced."""
    reqs = mirror.lag_requests(b, round(entries / mirror.LAG_DURATION_S))
    procs = max(1, b.pool.size)
    t0 = time.perf_counter()
    tasks = publish._tasks(b, b.leader().grpc_address, reqs, procs, PRELOAD_THREADS)
    res = b.pool.run(tasks, timeout_s=PRELOAD_TIMEOUT_S)
    failed = sum(r.failed for r in res)
    if failed:
        raise RuntimeError(f"{failed} preload publishes failed: {merge_errors(res)}")
    return {"entries": sum(r.summed for r in res), "seconds": time.perf_counter() - t0}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    base = tempfile.mkdtemp(prefix="kvdir-mirror-lag-")
    cfg = config.resolve(p.parse_args(["--entries", "1000", "--skip-memory", "--out-dir", base]))
    out: dict[str, Any] = {"preload_target": a.preload, "rate": a.rate, "dir": base, "runs": []}
    with WorkerPool(cfg.clients) as pool:
        cluster = make_cluster(base, cfg)
        b = Bench(cfg, cluster, pool)
        try:
            cluster.start(timeout_s=60)
            hb = publish.register(b)
            try:
                say(f"preloading {a.preload:,} entries")
                out["preload"] = preload(b, a.preload)
                target = b.follower()
                m, sync, start_s = mirror.start(b, target.grpc_address)
                out.update(replica=target.replica_id, start_s=start_s, entries=m.table.entries)
                try:
                    for i in range(a.repeat):
                        before = m.table.entries
                        # rate + i: each run's blocks are new (its keys are seeded by rate)
                        lg = mirror.lag(b, m, a.rate + i)
                        lg.update(entries_before=before, entries_after=m.table.entries)
                        say(
                            f"  run {i}: lag p99 {lg['lag_ms']['p99_ms']:.1f} ms at "
                            f"{lg['achieved_entries_per_s']:.0f} entries/s, table "
                            f"{before:,} -> {m.table.entries:,} entries, "
                            f"machine CPU busy {lg['machine_cpu_busy']:.2f}"
                        )
                        out["runs"].append(lg)
                finally:
                    sync.stop()
            finally:
                hb.stop_ev.set()
                hb.join(timeout=10)
        finally:
            b.close()
            cluster.stop()
    # The replicas' journals are ~0.5 GB at the default preload; kept (with their
    # logs) only when the run failed, since an error names the logs in it.
    shutil.rmtree(base, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.mirror_lag",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preload", type=int, default=2_400_000, help="entries before the lag runs")
    p.add_argument("--rate", type=int, default=mirror.LAG_ENTRIES_PER_S, help="entries/s")
    p.add_argument("--repeat", type=int, default=2, help="lag runs, one after the other")
    a = p.parse_args(argv)
    if a.preload < 0 or a.rate < 1000 or not 1 <= a.repeat <= 10:
        p.error("--preload must be >= 0, --rate >= 1000 and --repeat 1..10")
    print(json.dumps(measure(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
