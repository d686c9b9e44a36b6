"""The options of `kvdir bench transfer`, what they resolve to (`Config`), and its constants."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.command import add_quick_and_out_dir
from kvdir import report
from kvdir.core.client import namespace

MIB = 1 << 20
FIXED_BUFFER_BYTES = 4 << 20
"""A fixed SO_SNDBUF/SO_RCVBUF, compared with the kernel's autotuning (which the
product's tcp backend relies on: fixing the size gained nothing here)."""
MODEL = "meta-llama/Llama-3.1-8B"
KV_BYTES_PER_TOKEN = 128 << 10
"""Llama-3-8B: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16)."""
BLOCK_TOKENS = (16, 512)
SMALL_BLOCK_BYTES = 64 << 10
SMALL_MODEL = "kvdir-bench/64KiB-blocks"
FETCH_TIMEOUT_MS = 120_000
RPC_TIMEOUT_S = 180.0
VISIBLE_TIMEOUT_S = 5.0
TCP_RATIO_GOAL = 0.8
SHM_RATIO_GOAL = 0.8
STORED_P99_GOAL_US = 20.0
VISIBLE_P99_GOAL_MS = 50.0
STORED_PACE_S = 0.0005
"""Sleep between paced stored() calls (each call then starts cold, as after an idle gap)."""
PROBE_NODE = "bench-probe"
MEMORY_SHARE_MAX = 0.6
"""Refuse to start when the estimated peak exceeds this share of MemAvailable."""

NS_BY_TOKENS = {t: namespace(MODEL, t, dtype="bf16", layout="vllm-paged") for t in BLOCK_TOKENS}
NS_SMALL = namespace(SMALL_MODEL, 16, dtype="bf16")


class BenchError(RuntimeError):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes-mb",
        default=None,
        help="comma-separated fetch sizes in MiB (default 128,500; --quick: 64)",
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed fetches per case (default 5; --quick: 2)"
    )
    p.add_argument(
        "--overhead-reps",
        type=int,
        default=None,
        help="single-block fetches per transport (default 50; --quick: 10)",
    )
    p.add_argument(
        "--stored-calls",
        type=int,
        default=None,
        help="stored() calls per batch size (default 10000; --quick: 2000)",
    )
    p.add_argument(
        "--visibility-trials",
        type=int,
        default=None,
        help="stored()-to-visible trials (default 200; --quick: 30)",
    )
    add_quick_and_out_dir(p, "transfer")
    p.add_argument(
        "--poll-gap-ms",
        type=float,
        default=2.0,
        help="sleep between visibility polls (default 2; 0 polls back to back, which on a "
        "2-core machine starves the path being measured)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the benchmark's randomness")
    p.add_argument(
        "--transport",
        choices=["tcp-shm", "rdma"],
        default="tcp-shm",
        help="tcp-shm: the agent benchmark above; rdma: kvdir's RDMA READs next to "
        "perftest's ib_read_bw on this machine's RDMA device (bench/rdma.py)",
    )
    p.add_argument("--segment-mb", type=float, default=None, help="rdma: segment size (1)")
    p.add_argument("--segments", type=int, default=64, help="rdma: segments per kvdir read")
    p.add_argument("--rounds", type=int, default=5, help="rdma: interleaved rounds")
    p.add_argument("--perftest-iters", type=int, default=200, help="rdma: ib_read_bw -n")


@dataclass(frozen=True, slots=True)
class Config:
    sizes_mib: tuple[float, ...]
    reps: int
    overhead_reps: int
    stored_calls: int
    visibility_trials: int
    quick: bool
    out_dir: Path
    seed: int
    poll_gap_s: float = 0.002


def resolve(args: argparse.Namespace) -> Config:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    sizes_raw = pick(args.sizes_mb, "128,500", "64")
    try:
        sizes = tuple(float(s) for s in str(sizes_raw).split(",") if s.strip())
    except ValueError as e:
        raise BenchError(f"--sizes-mb {sizes_raw!r}: {e}") from e
    if not sizes or any(s <= 0 for s in sizes):
        raise BenchError("--sizes-mb needs positive sizes")
    cfg = Config(
        sizes_mib=sizes,
        reps=int(pick(args.reps, 5, 2)),
        overhead_reps=int(pick(args.overhead_reps, 50, 10)),
        stored_calls=int(pick(args.stored_calls, 10_000, 2_000)),
        visibility_trials=int(pick(args.visibility_trials, 200, 30)),
        quick=quick,
        out_dir=Path(args.out_dir) if args.out_dir else report.REPO_ROOT / "bench" / "results",
        seed=int(args.seed),
        poll_gap_s=float(args.poll_gap_ms) / 1e3,
    )
    for name in ("reps", "overhead_reps", "stored_calls", "visibility_trials"):
        if getattr(cfg, name) <= 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0")
    if cfg.poll_gap_s < 0:
        raise BenchError("--poll-gap-ms must be >= 0")
    if cfg.visibility_trials > 5_000:
        raise BenchError("--visibility-trials is at most 5000")
    return cfg
