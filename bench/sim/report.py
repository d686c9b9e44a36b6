"""A `kvdir sim` run on record: its JSON (`--out`) and the markdown of merged runs (`--merge`).

A run's JSON holds what makes it a result: the command, the commit (with
"+dirty" when the simulator or the product differ from it), the machine and
its load, the dates, the wall and CPU seconds, and every seed's result
(seed, steps, failed, kinds, first violation, CPU seconds). `merge` reads
several (pieces of one long run, on one machine or several), checks that
they ran the same steps and replicas, and writes the markdown: commands,
commits, machines, the seeds covered (a range when contiguous, else listed),
steps, rates, every failure with its first violation, and where the seeds
that failed before each fix are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.sim.knobs import Result

FORMAT = 1
CHECKOUT = Path(__file__).resolve().parents[2]
BEFORE_FIXES = """\
## Seeds that failed before each fix

Recorded in [raft-sim-2026-12-03.md](raft-sim-2026-12-03.md) (every seed, its violations
and its first one, in tables):

- Holes 1 and 3 and the snapshot-chunk commit index (fixed in bf97ea0 and be749fc):
  on f4a7c8a's directory/, **29 of the 100 CI seeds** (1-100, 1,000 steps) failed
  (cut_matching 23, tick_error 9, cut_committed 4, and seed 36: applied_uncommitted,
  committed_entry_differs, digest_differs, lost_write), and **184 of 385 long-run
  seeds** (1-385, 2,000 steps).
- Membership rebuilt from snapshots after restarts (fixed in 80e4bd4): seed 317
  (2,000 steps) lost 20 acknowledged writes on 3cca776.
- Hole 6 (a mirror read ahead of the commit index it had heard of): explained and
  fixed in e185032 (kvdir/core/mirror.py, with a unit test); the simulator's mirror
  checks (`mirror_ahead`, `mirror_ahead_of_heard`) cover it on every seed since.
- tests/sim/test_raft_sim.py keeps one regression seed per fix (`REGRESSION_SEEDS`).
"""


@dataclass
class Run:
    """The circumstances of one `kvdir sim` run."""

    command: str
    started: str
    t0: float
    cpu0: float
    load_start: tuple[float, float, float]
    args: dict[str, Any]

    @classmethod
    def begin(cls, args: argparse.Namespace) -> Run:
        kept = {k: v for k, v in vars(args).items() if k not in ("func", "merge", "report")}
        return cls(
            command=" ".join(["python3 -m kvdir.cli", *sys.argv[1:]]),
            started=_now(),
            t0=time.monotonic(),
            cpu0=_cpu(),
            load_start=os.getloadavg(),
            args=kept,
        )

    def wall(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self, budget_s: float) -> bool:
        return budget_s > 0 and self.wall() >= budget_s


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def progress(results: list[Result], wall: float) -> str:
    steps = sum(_steps(r) for r in results)
    cpu = sum(r.seconds for r in results)
    failed = [r.seed for r in results if not r.ok]
    return (
        f"{len(results)} seeds, {steps} steps in {wall:.1f} s: {steps / max(wall, 1e-9):,.0f} "
        f"steps/s ({steps / max(cpu, 1e-9):,.0f} per CPU-second); failed: {len(failed)}"
        + (f" {failed[:20]}" if failed else "")
    )


def _steps(r: Result) -> int:
    return int(r.stats.get("steps_run", r.steps))


def commit(given: str = "") -> str:
    """The checkout's commit ("+dirty" if the simulator or the product differ from it);
    `given` (`--commit`) for a copied tree without git."""
    if given:
        return f"{given} (as given)"
    try:
        out = _git("rev-parse", "--short", "HEAD")
        dirty = _git(
            "status", "--porcelain", "--", "directory", "kvdir", "bench/sim", "bench/chaos"
        )
        return out.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, cwd=CHECKOUT
    ).stdout


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} cpus {model}, Python {platform.python_version()}"


def write(path: str, run: Run, results: list[Result], partial: bool = False) -> None:
    """`partial`: the run is still going (a checkpoint); else it ended."""
    steps = sum(_steps(r) for r in results)
    cpu = _cpu() - run.cpu0
    doc: dict[str, Any] = {
        "format": FORMAT,
        "partial": partial,
        "command": run.command,
        "commit": commit(str(run.args.get("commit", ""))),
        "machine": machine(),
        "nice": os.nice(0),
        "started": run.started,
        "ended": _now(),
        "load_start": [round(x, 2) for x in run.load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "args": run.args,
        "wall_s": round(run.wall(), 1),
        "cpu_s": round(cpu, 1),
        "seeds_run": len(results),
        "steps_run": steps,
        "failed_seeds": [r.seed for r in results if not r.ok],
        "seeds": [
            {
                "seed": r.seed,
                "steps": _steps(r),
                "failed": not r.ok,
                "kinds": sorted({v.kind for v in r.violations}),
                "first": str(r.violations[0]) if r.violations else "",
                "cpu_s": round(r.seconds, 3),
            }
            for r in results
        ],
    }
    seeds = doc.pop("seeds")
    head = json.dumps(doc, indent=1)[:-2]  # without its closing brace: the seeds follow
    rows = ",\n".join(json.dumps(s) for s in seeds)  # one line per seed
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f'{head},\n "seeds": [\n{rows}\n ]\n}}\n')
    os.replace(tmp, path)


# ---------------------------------------------------------------- merging


def merge(paths: list[str], out: str) -> int:
    """Combine runs' JSON into one markdown report (`out`, or stdout when empty)."""
    try:
        docs = [_load(p) for p in paths]
    except (OSError, ValueError, KeyError) as e:
        print(f"kvdir sim --merge: {e}", file=sys.stderr)
        return 2
    shapes = {(d["args"]["steps"], d["args"]["replicas"]) for d in docs}
    if len(shapes) != 1:
        print(f"kvdir sim --merge: runs of different shapes {sorted(shapes)}", file=sys.stderr)
        return 2
    text = markdown(docs, paths)
    if out:
        Path(out).write_text(text)
    else:
        print(text, end="")
    failed = any(s["failed"] for d in docs for s in d["seeds"])
    return 1 if failed else 0


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a `kvdir sim --out` file of format {FORMAT}")
    return doc


def seed_ranges(seeds: list[int]) -> str:
    """ "1-5000, 5003, 5010-5020": the seeds as ranges."""
    out: list[str] = []
    ss = sorted(set(seeds))
    i = 0
    while i < len(ss):
        j = i
        while j + 1 < len(ss) and ss[j + 1] == ss[j] + 1:
            j += 1
        out.append(str(ss[i]) if i == j else f"{ss[i]}-{ss[j]}")
        i = j + 1
    return ", ".join(out)


def markdown(docs: list[dict[str, Any]], paths: list[str]) -> str:
    seeds: dict[int, dict[str, Any]] = {}
    repeats = 0
    for d in docs:
        for s in d["seeds"]:
            repeats += s["seed"] in seeds
            seeds[s["seed"]] = s
    steps_each, replicas = docs[0]["args"]["steps"], docs[0]["args"]["replicas"]
    steps = sum(s["steps"] for s in seeds.values())
    wall = sum(d["wall_s"] for d in docs)
    cpu = sum(d["cpu_s"] for d in docs)
    seed_cpu = sum(s["cpu_s"] for s in seeds.values())
    failed = [s for _, s in sorted(seeds.items()) if s["failed"]]
    kinds: Counter[str] = Counter(k for s in failed for k in s["kinds"])
    lo, hi = min(seeds, default=0), max(seeds, default=0)
    contiguous = len(seeds) == hi - lo + 1
    lines = [
        f"# The seeded simulator, long run: {len(seeds):,} seeds x {steps_each:,} steps "
        f"({replicas} replicas)",
        "",
        f"Merged by `kvdir sim --merge {' '.join(paths)}` on {_now()}.",
        "",
        f"- **Seeds covered: {seed_ranges(list(seeds))}** "
        + ("(contiguous)" if contiguous else "(not contiguous: the ranges above)")
        + (f"; {repeats} seeds ran twice (the later result kept)" if repeats else ""),
        f"- Steps: {steps:,} (faults for {steps_each:,} per seed, then healing until every "
        "replica and the mirror caught up: counted too)",
        f"- Wall {wall:,.0f} s, CPU {cpu:,.0f} s over the pieces: "
        f"{steps / max(seed_cpu, 1e-9):,.0f} steps per CPU-second of the seeds",
        f"- **Failed: {len(failed)}**"
        + (f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})" if failed else ""),
        "",
        "## Pieces",
        "",
        "| command | commit | machine | nice | started | ended | load (1 min) start/end "
        "| seeds | steps | wall s | CPU s | steps/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in docs:
        ps = [s["seed"] for s in d["seeds"]]
        ended = d["ended"] + (" (its last checkpoint)" if d.get("partial") else "")
        lines.append(
            f"| `{d['command']}` | {d['commit']} | {d['machine']} | {d['nice']} "
            f"| {d['started']} | {ended} "
            f"| {d['load_start'][0]} / {d['load_end'][0]} "
            f"| {seed_ranges(ps)} | {d['steps_run']:,} | {d['wall_s']:,} | {d['cpu_s']:,} "
            f"| {d['steps_run'] / max(d['wall_s'], 1e-9):,.0f} |"
        )
    lines += ["", "## Failures", ""]
    if failed:
        lines += ["| seed | violations | first |", "| --- | --- | --- |"]
        lines += [f"| {s['seed']} | {', '.join(s['kinds'])} | {s['first']} |" for s in failed]
        lines.append("")
        lines.append(
            "Replay one: `python3 -m kvdir.cli sim --seed S --seeds 1 "
            f"--steps {steps_each} --replicas {replicas} --trace`."
        )
    else:
        lines.append("None.")
    lines += ["", BEFORE_FIXES]
    return "\n".join(lines)


__all__ = ["Run", "commit", "machine", "merge", "progress", "seed_ranges", "write"]
