"""`kvdir sim`: many seeds of the simulator, in parallel processes; failing seeds listed.

Each seed is independent and deterministic, so seeds are spread over worker
processes and the report is the same whatever the number of workers. A
failing seed is printed with its violations and the end of its trace; rerun
it alone with `--seed S --seeds 1 --trace` to see the whole trace.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.sim.checks import Violation
from bench.sim.simulation import Result, run_seed

PROGRESS_EVERY_S = 30.0


def _one(job: tuple[int, int, int]) -> Result:
    """One seed; an exception of the simulator itself is that seed's failure, not the run's."""
    seed, steps, replicas = job
    try:
        return run_seed(seed, steps, replicas)
    except Exception as e:
        res = Result(seed, steps, replicas)
        where = traceback.extract_tb(e.__traceback__)[-1]
        detail = f"{type(e).__name__}: {e} at {where.filename}:{where.lineno}"
        res.violations.append(Violation("simulator_error", 0, detail))
        return res


def cmd_sim(args: argparse.Namespace) -> int:
    if args.replicas not in (3, 5):
        print("kvdir sim: --replicas must be 3 or 5", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.steps < 1:
        print("kvdir sim: --seeds and --steps must be at least 1", file=sys.stderr)
        return 2
    jobs = [(args.seed + i, args.steps, args.replicas) for i in range(args.seeds)]
    t0 = time.perf_counter()
    results: list[Result] = []
    last = t0
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for res in pool.map(_one, jobs, chunksize=4):
            results.append(res)
            if not res.ok:
                print(res.summary(), flush=True)
                if args.trace:
                    print("\n".join(res.trace))
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                print(_progress(results, now - t0), flush=True)
            if args.max_seconds and now - t0 >= args.max_seconds:
                pool.shutdown(wait=False, cancel_futures=True)
                break
    wall = time.perf_counter() - t0
    print(_progress(results, wall))
    if args.out:
        _write(args, results, wall)
    return 0 if all(r.ok for r in results) else 1


def _progress(results: list[Result], wall: float) -> str:
    steps = sum(int(r.stats.get("steps_run", r.steps)) for r in results)
    cpu = sum(r.seconds for r in results)
    failed = [r.seed for r in results if not r.ok]
    return (
        f"{len(results)} seeds, {steps} steps in {wall:.1f} s: {steps / max(wall, 1e-9):,.0f} "
        f"steps/s ({steps / max(cpu, 1e-9):,.0f} per busy worker); failed: {len(failed)}"
        + (f" {failed[:20]}" if failed else "")
    )


CHECKOUT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    """The checkout's commit ("+dirty" if the simulator or the product differ from it)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=CHECKOUT,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "directory", "bench/sim"],
            capture_output=True,
            text=True,
            check=True,
            cwd=CHECKOUT,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(args: argparse.Namespace, results: list[Result], wall: float) -> None:
    steps = sum(int(r.stats.get("steps_run", r.steps)) for r in results)
    kinds: Counter[str] = Counter()
    for r in results:
        kinds.update({v.kind for v in r.violations})
    doc: dict[str, Any] = {
        "command": " ".join(["kvdir", "sim", *sys.argv[2:]]) if len(sys.argv) > 1 else "",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
        "seeds_asked": args.seeds,
        "seeds_run": len(results),
        "first_seed": args.seed,
        "steps_per_seed": args.steps,
        "replicas": args.replicas,
        "workers": args.jobs,
        "wall_s": round(wall, 1),
        "steps_run": steps,
        "steps_per_s": round(steps / max(wall, 1e-9)),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "failures_by_kind": dict(sorted(kinds.items())),
        "failures": [
            {
                "seed": r.seed,
                "kinds": sorted({v.kind for v in r.violations}),
                "first": str(r.violations[0]),
            }
            for r in results
            if not r.ok
        ],
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


__all__ = ["cmd_sim"]
