"""`kvdir demo`: the main job, short, on embedded defaults.

A short `kvdir bench replay` (docs/replay.md): a real 3-replica directory
(three `kvdir directory serve` processes on 127.0.0.1 with their own Raft
journals) and, for each scenario, `--nodes` real `kvdir agent serve`
processes with their own shared-memory KV pools replay a deterministic
synthetic multi-turn trace in the Mooncake format (`trace.synthesize`; no
file needed). Every block is real bytes in a pool slot, every pull a
validated fetch between agents checked byte for byte; only the GPUs are
simulated (H200 figures of ../shared/MISSION.md). It prints the scenario
table (A local cache only, B pull over TCP, C pool over shm and over RDMA
(modelled), D affinity routing + pool, and the ideal row) and exits non-zero
if any delivered block was wrong or the real pools disagreed with the model.
Runs in about a minute on two cores; nothing is written outside a temp dir.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvdir.replay import RUN_ERRORS, ReplayError, Settings, replay

DEMO_NODES = 4
DEMO_CONVERSATIONS = 60
DEMO = Settings(
    trace=None,
    nodes=DEMO_NODES,
    speedup=4.0,
    gpus_per_node=1,
    kv_gib_per_node=64.0,
    block_bytes=4096,
    sweep=(),
    synth_conversations=DEMO_CONVERSATIONS,
)
"""Embedded defaults: 4 single-GPU nodes (llama-70b shape) with 64 GiB of KV each
(409 blocks, so LRU eviction happens), the synthetic trace 4x compressed."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="a short cluster replay over a real directory and real agents (prints the table)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=DEMO_NODES)
    p.add_argument(
        "--conversations",
        type=int,
        default=None,
        help=f"default {DEMO_CONVERSATIONS} (with --engine vllm: 3 per scenario)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="vllm: real vLLM CPU servers behind kvdir gateway (kvdir/replay/vllm_demo.py)",
    )
    p.add_argument("--out", default="", help="--engine vllm: also write Markdown + JSON here")
    p.set_defaults(func=run)


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvdir.replay import vllm_demo

        return vllm_demo.run(args)
    s = Settings(**{**vars(DEMO), "nodes": args.nodes, "seed": args.seed})
    s.synth_conversations = args.conversations or DEMO_CONVERSATIONS
    s.progress = not args.no_progress
    step(
        f"replaying {s.synth_conversations} synthetic conversations on {s.nodes} nodes: "
        f"a real 3-replica directory, {s.nodes} real agents per scenario, simulated GPUs"
    )
    try:
        rep = replay(s)
    except ReplayError as e:
        print(f"kvdir demo: {e}", file=sys.stderr)
        return 2
    except RUN_ERRORS as e:
        print(f"kvdir demo: the real cluster failed: {e}", file=sys.stderr)
        return 1
    print(rep.markdown())
    wrong = sum(r["real"]["wrong_blocks"] for r in rep.rows)
    mismatches = sum(r["real"]["model_mismatches"] for r in rep.rows)
    fetched = sum(r["real"]["fetches"] for r in rep.rows)
    if wrong or mismatches or not fetched:
        step(
            f"demo FAILED: {wrong} wrong blocks delivered, {mismatches} pool/model "
            f"disagreements, {fetched} fetches"
        )
        return 1
    step(f"demo finished in {rep.wall_s:.0f} s: {fetched} validated fetches, no wrong bytes")
    return 0
