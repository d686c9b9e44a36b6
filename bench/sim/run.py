"""`kvdir sim`: a range of seeds in worker processes, within a wall-time budget.

Each seed is independent and deterministic, so seeds are spread over worker
processes and the result is the same whatever the number of workers. Seeds
are started in order, at most `--jobs` at a time; once `--budget-s` has
passed no new seed starts, the running ones finish, and the seeds covered
are exactly `--seed` to the last one started. A failing seed is printed
with its violations and the end of its trace; rerun it alone with
`--seed S --seeds 1 --trace` to see the whole trace. `--out` writes every
seed's result and the run's circumstances (`report`), which `--merge`
combines into the markdown of a long run; it is rewritten with what has
finished every `PROGRESS_EVERY_S` ("partial": true), so a run killed from
outside still leaves its results.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from bench.sim import report
from bench.sim.checks import Violation
from bench.sim.groups import run_groups
from bench.sim.knobs import Result
from bench.sim.simulation import run_seed

PROGRESS_EVERY_S = 30.0


def _one(job: tuple[int, int, int, bool, int]) -> Result:
    """One seed; an exception of the simulator itself is that seed's failure, not the run's.
    Only a failing seed's trace travels back (its tail, or all of it with `full_trace`).
    With `groups` of 2 or more, a run of that many groups (`groups.run_groups`)."""
    seed, steps, replicas, full_trace, groups = job
    t0 = time.process_time()
    try:
        res = run_groups(seed, steps, groups) if groups > 1 else run_seed(seed, steps, replicas)
        res.trace = res.trace if full_trace else res.tail() if res.violations else []
        return res
    except Exception as e:
        res = Result(seed, steps, replicas, seconds=time.process_time() - t0)
        where = traceback.extract_tb(e.__traceback__)[-1]
        detail = f"{type(e).__name__}: {e} at {where.filename}:{where.lineno}"
        res.violations.append(Violation("simulator_error", 0, detail))
        return res


def cmd_sim(args: argparse.Namespace) -> int:
    if args.merge:
        return report.merge(args.merge, args.report)
    if args.replicas not in (3, 5):
        print("kvdir sim: --replicas must be 3 or 5", file=sys.stderr)
        return 2
    if args.groups < 1:
        print("kvdir sim: --groups must be at least 1", file=sys.stderr)
        return 2
    if args.groups > 1 and args.replicas != 3:
        print("kvdir sim: a run of groups has 3 replicas per group", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.steps < 1 or args.jobs < 1:
        print("kvdir sim: --seeds, --steps and --jobs must be at least 1", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else ""
    if out_dir and not os.access(out_dir, os.W_OK):
        print(f"kvdir sim: cannot write --out in {out_dir}", file=sys.stderr)
        return 2
    run = report.Run.begin(args)
    results = _run_seeds(args, run)
    print(report.progress(results, run.wall()))
    if args.out:
        report.write(args.out, run, results)
    return 0 if all(r.ok for r in results) else 1


def _run_seeds(args: argparse.Namespace, run: report.Run) -> list[Result]:
    todo = [
        (args.seed + i, args.steps, args.replicas, args.trace, args.groups)
        for i in range(args.seeds)
    ]
    todo.reverse()  # popped from the end: seeds start in order
    results: list[Result] = []
    inflight: set[Future[Result]] = set()
    last = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        while todo or inflight:
            while todo and len(inflight) < args.jobs and not run.over_budget(args.budget_s):
                inflight.add(pool.submit(_one, todo.pop()))
            if not inflight:
                break  # over budget: the seeds not started stay out of the run
            done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: f.result().seed):
                res = fut.result()
                results.append(res)
                if not res.ok:
                    print(res.summary(), flush=True)
                    if args.trace:
                        print("\n".join(res.trace))
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                print(report.progress(results, run.wall()), flush=True)
                if args.out:  # a run killed from outside still leaves what finished
                    report.write(args.out, run, sorted(results, key=lambda r: r.seed), True)
    results.sort(key=lambda r: r.seed)
    return results


__all__ = ["cmd_sim"]
