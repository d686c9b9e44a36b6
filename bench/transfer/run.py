"""`kvdir bench transfer`'s entry: the phase registry, the run, the output files."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.measure import say
from bench.transfer import fetch, overhead, stored, visibility
from bench.transfer import report as transfer_report
from bench.transfer.config import KV_BYTES_PER_TOKEN, Config, resolve
from bench.transfer.setup import Bench, environment, sigterm_as_exit
from kvdir import report

PHASES: tuple[Callable[[Bench], None], ...] = (
    fetch.run,
    overhead.run,
    visibility.run,
    stored.run,
)
"""The phases, in order, after the directory and agents started; each writes its
own key of `Bench.results`."""


def config_record(cfg: Config) -> dict[str, Any]:
    return {
        "sizes_mib": list(cfg.sizes_mib),
        "reps": cfg.reps,
        "overhead_reps": cfg.overhead_reps,
        "stored_calls": cfg.stored_calls,
        "visibility_trials": cfg.visibility_trials,
        "poll_gap_ms": cfg.poll_gap_s * 1e3,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "raw_socket": "two processes: this one receives, a child process sends",
    }


def measure_all(cfg: Config, base: str, data: dict[str, Any]) -> None:
    """Start, run every phase, stop; a failure is recorded in `data['error']`."""
    bench = Bench(cfg, base)
    try:
        data["config"]["memory"] = bench.check_memory()
        bench.start()
        for phase in PHASES:
            phase(bench)
    except (Exception, KeyboardInterrupt, SystemExit) as e:
        data["error"] = traceback.format_exc()
        say(f"benchmark failed: {e!r}")
        tails = bench.log_tails()
        if tails:
            say("agent log tails:\n" + tails)
    finally:
        data["results"].update(bench.results)
        bench.close()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "transport", "tcp-shm") == "rdma":
        from bench import rdma

        return rdma.run(args)
    cfg = resolve(args)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    data: dict[str, Any] = {"header": report.header(started), "config": config_record(cfg)}
    data["header"]["environment"] = {"start": environment()}
    data["results"] = {}
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    base = tempfile.mkdtemp(prefix="kvdir-bench-transfer-", dir=shm_root)
    say(f"agent pools, replica data and logs under {base}")
    with sigterm_as_exit():
        try:
            measure_all(cfg, base, data)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    data["header"]["environment"]["end"] = environment()
    data["header"]["wall_s"] = time.monotonic() - t0
    data["targets"] = [t.as_dict() for t in transfer_report.targets(data["results"])]
    md = transfer_report.markdown(data)
    md_path, js_path = report.write(cfg.out_dir, f"transfer-{started:%Y-%m-%d}", md, data)
    print(md)
    say(f"wrote {md_path} and {js_path}")
    return 1 if "error" in data else 0
