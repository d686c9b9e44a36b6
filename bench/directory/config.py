"""The options of `kvdir bench directory` and what they resolve to (`Config`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.command import add_quick_and_out_dir
from kvdir import report
from kvdir.directory.consensus.tuning import RaftTuning

ONLY = {"compaction": ("publish load", "compaction")}
"""`--only` choices: the phases each runs (the load first: the others need the table)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--entries",
        type=int,
        default=None,
        help="(block, holder) entries to load (default 1000000; --quick: 60000)",
    )
    p.add_argument(
        "--memory-entries",
        type=int,
        default=None,
        help="entries of the table-memory measurement (default 10000000)",
    )
    p.add_argument("--kills", type=int, default=None, help="leader SIGKILLs (default 5)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per measured lookup/echo phase (default 10)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=4,
        help="client processes for the throughput phases (default 4)",
    )
    p.add_argument("--batch-chains", type=int, default=32, help="chains per LookupBatch")
    p.add_argument("--publish-batch", type=int, default=1024, help="entries per Publish")
    p.add_argument(
        "--publish-inflight",
        type=int,
        default=8,
        help="Publish RPCs in flight during the load (default 8)",
    )
    p.add_argument(
        "--raft-compaction-min-entries",
        type=int,
        default=None,
        help="run the replicas with this RaftTuning.compaction_min_entries "
        "(through `directory serve --tune`; default: the product default)",
    )
    p.add_argument(
        "--raft-compaction-min-time-s",
        type=float,
        default=None,
        help="run the replicas with this RaftTuning.compaction_min_time_s",
    )
    p.add_argument("--skip-memory", action="store_true", help="skip the 10M-entry table run")
    p.add_argument(
        "--only",
        choices=sorted(ONLY),
        default=None,
        help="run only the load (--entries) and this phase; no table-memory run "
        "(compaction: the publish load on, terms and Raft tick stalls across it)",
    )
    p.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="the sharded directory instead: N groups x 3 replicas for each N, in one run "
        "(publish, CPU and bytes per entry, mirror and RPC lookups, leader kills; "
        "bench/directory/shards.py)",
    )
    p.add_argument(
        "--evidence",
        action="store_true",
        help="with --shards 4: issue 31's evidence run (publishers through the sharded "
        "client, leader kills, a split and a move while they publish, every acknowledged "
        "entry looked up, replica and mirror digests; default --entries 8000000; "
        "bench/directory/evidence.py)",
    )
    p.add_argument(
        "--verify-s",
        type=float,
        default=300.0,
        help="--evidence: seconds for looking up the acknowledged entries (complete if it "
        "fits, else a uniform sample, said in the report; default 300)",
    )
    add_quick_and_out_dir(p, "directory")
    p.add_argument(
        "--dir",
        default=None,
        help="replica data and logs (default: a temp dir, removed on success)",
    )
    p.add_argument("--seed", type=int, default=1)


@dataclass(frozen=True, slots=True)
class Config:
    entries: int
    memory_entries: int
    kills: int
    duration_s: float
    clients: int
    batch_chains: int
    publish_batch: int
    publish_inflight: int
    compaction_min_entries: int | None
    compaction_min_time_s: float | None
    skip_memory: bool
    only: str | None
    quick: bool
    out_dir: Path
    data_dir: str | None
    seed: int
    shards: tuple[int, ...] = ()
    evidence: bool = False
    verify_s: float = 300.0

    @property
    def tuning(self) -> RaftTuning:
        t = RaftTuning()
        if self.compaction_min_entries is not None:
            t = replace(t, compaction_min_entries=self.compaction_min_entries)
        if self.compaction_min_time_s is not None:
            t = replace(t, compaction_min_time_s=self.compaction_min_time_s)
        return t

    @property
    def raft_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.compaction_min_entries is not None:
            out["compaction_min_entries"] = self.compaction_min_entries
        if self.compaction_min_time_s is not None:
            out["compaction_min_time_s"] = self.compaction_min_time_s
        return out


def resolve(args: argparse.Namespace) -> Config:
    q = bool(args.quick)

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    out_dir = Path(args.out_dir) if args.out_dir else report.REPO_ROOT / "bench" / "results"
    cfg = Config(
        entries=pick(args.entries, 8_000_000 if args.evidence else 1_000_000, 60_000),
        memory_entries=pick(args.memory_entries, 10_000_000, 300_000),
        kills=pick(args.kills, 5, 2),
        duration_s=pick(args.duration, 10.0, 2.0),
        clients=args.clients,
        batch_chains=args.batch_chains,
        publish_batch=args.publish_batch,
        publish_inflight=args.publish_inflight,
        compaction_min_entries=pick(args.raft_compaction_min_entries, None, 500),
        compaction_min_time_s=pick(args.raft_compaction_min_time_s, None, 15.0),
        skip_memory=bool(args.skip_memory) or args.only is not None,
        only=args.only,
        quick=q,
        out_dir=out_dir,
        data_dir=args.dir,
        seed=args.seed,
        shards=tuple(args.shards or ()),
        evidence=bool(args.evidence),
        verify_s=args.verify_s,
    )
    checks = [
        (cfg.entries >= 1000, "--entries must be >= 1000"),
        (cfg.memory_entries >= 1000, "--memory-entries must be >= 1000"),
        (0 <= cfg.kills <= 100, "--kills must be 0..100"),
        (0.5 <= cfg.duration_s <= 600, "--duration must be 0.5..600 s"),
        (1 <= cfg.clients <= 64, "--clients must be 1..64"),
        (1 <= cfg.batch_chains <= 256, "--batch-chains must be 1..256"),
        (1 <= cfg.publish_batch <= 8192, "--publish-batch must be 1..8192"),
        (1 <= cfg.publish_inflight <= 256, "--publish-inflight must be 1..256"),
        (all(1 <= n <= 16 for n in cfg.shards), "--shards sizes must be 1..16"),
        (not cfg.evidence or cfg.shards == (4,), "--evidence needs --shards 4"),
        (1 <= cfg.verify_s <= 3600, "--verify-s must be 1..3600"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"kvdir: error: {msg}")
    return cfg
