"""`kvdir bench routing`: routing policies replayed over a request trace (pure, no I/O).

Each request of a Mooncake-format trace (`hash_ids`: one id per 512-token
block, equal ids = equal prefixes; `input_length`, `output_length`,
`timestamp` in ms) is routed by `kvdir.routing.Router` over `--nodes` nodes.
Each node keeps an LRU cache of blocks with a finite capacity (KV GiB of the
model shape); the directory's answer is exactly what the nodes hold, so the
router sees per-node contiguous prefixes. A request served on a node
inserts (and refreshes) all its blocks there; pulled blocks are inserted too.

Load, the router's input, is the number of a node's requests still running
at arrival: a request runs for the prefill of its uncached tokens (the
shape's fitted prefill time) plus `output_length * --decode-s`.

The ideal is an infinite cache shared by every node: a block hits if any
earlier request had it. Reported per policy: hit rate (cached prompt tokens,
local or pulled, over all prompt tokens), its ratio to the ideal, and the
busiest node's requests over the mean (and its computed prefill tokens over
the mean).

Targets (issue 6): affinity within 10% of the ideal hit rate
(affinity / ideal >= 0.9) with the busiest node under 1.5x the mean load.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import heapq
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdir import report
from kvdir.routing import SHAPES, Balance, Candidate, CostModel, Holder, Policy, Prompt, Router

TRACE_BLOCK_TOKENS = 512
"""Mooncake traces hash 512-token blocks."""
TARGET_HIT_RATIO = 0.9
TARGET_LOAD_RATIO = 1.5


@dataclass(frozen=True, slots=True)
class Request:
    t_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int = 0) -> list[Request]:
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                Request(
                    r["timestamp"] / 1000,
                    int(r["input_length"]),
                    int(r["output_length"]),
                    tuple(r["hash_ids"]),
                )
            )
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.t_s)
    return out


def block_tokens(r: Request, i: int) -> int:
    """Tokens of block `i` of `r` (the last block may be partial)."""
    return max(0, min(TRACE_BLOCK_TOKENS, r.input_tokens - i * TRACE_BLOCK_TOKENS))


def prefix_tokens(r: Request, blocks: int) -> int:
    return sum(block_tokens(r, i) for i in range(blocks))


class Node:
    def __init__(self, node_id: str, capacity_blocks: int) -> None:
        self.node_id = node_id
        self.capacity = capacity_blocks
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.running: list[float] = []  # finish times (a heap)
        self.requests = 0
        self.computed_tokens = 0

    def prefix(self, blocks: Sequence[int]) -> int:
        n = 0
        while n < len(blocks) and blocks[n] in self.cache:
            n += 1
        return n

    def load(self, now: float) -> int:
        while self.running and self.running[0] <= now:
            heapq.heappop(self.running)
        return len(self.running)

    def insert(self, blocks: Sequence[int]) -> None:
        c = self.cache
        for b in blocks:
            if b in c:
                c.move_to_end(b)
            else:
                c[b] = None
        while len(c) > self.capacity:
            c.popitem(last=False)


def ideal(trace: Sequence[Request], capacity_blocks: int = 0) -> float:
    """Hit rate of one cache shared by all nodes (contiguous prefix from block 0).

    `capacity_blocks` 0: infinite (the issue's ideal); otherwise one LRU of that size.
    """
    shared = Node("all", capacity_blocks or 1 << 62)
    hit = total = 0
    for r in trace:
        hit += prefix_tokens(r, shared.prefix(r.blocks))
        total += r.input_tokens
        shared.insert(r.blocks)
    return hit / total if total else 0.0


def simulate(
    trace: Sequence[Request],
    policy: Policy,
    nodes: int,
    capacity_blocks: int,
    decode_s: float,
    shape: str,
    balance: Balance,
    seed: int,
) -> dict[str, Any]:
    cost = CostModel(block_tokens=TRACE_BLOCK_TOKENS, shape=SHAPES[shape])
    router = Router(policy, cost, random.Random(seed), balance)
    ns = [Node(f"n{i:02d}", capacity_blocks) for i in range(nodes)]
    transports = frozenset({"rdma"})
    hit = pulled = total = 0
    rules: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for r in trace:
        holders = {}
        for n in ns:
            p = n.prefix(r.blocks)
            if p:
                holders[n.node_id] = Holder(n.node_id, p, n.node_id, transports)
        prompt = Prompt(len(r.blocks), holders)
        cands = [Candidate(n.node_id, n.load(r.t_s), n.node_id, transports) for n in ns]
        d = router.decide(cands, prompt)
        rules[d.rule.value] += 1
        node = ns[int(d.node_id[1:])]
        cached = d.local_blocks + d.pulled_blocks
        hit_tokens = prefix_tokens(r, cached)
        hit += hit_tokens
        pulled += prefix_tokens(r, cached) - prefix_tokens(r, d.local_blocks)
        total += r.input_tokens
        computed = r.input_tokens - hit_tokens
        node.requests += 1
        node.computed_tokens += computed
        run_s = cost.prefill.recompute_s(hit_tokens, r.input_tokens) + r.output_tokens * decode_s
        heapq.heappush(node.running, r.t_s + run_s)
        node.insert(r.blocks)
    reqs = [n.requests for n in ns]
    work = [n.computed_tokens for n in ns]
    return {
        "policy": policy.value,
        "hit_rate": hit / total if total else 0.0,
        "pulled_share": pulled / total if total else 0.0,
        "busiest_over_mean_requests": max(reqs) / (sum(reqs) / len(reqs)),
        "busiest_over_mean_prefill": max(work) / (sum(work) / len(work)) if sum(work) else 0.0,
        "rules": dict(rules),
        "decide_us_per_request": (time.perf_counter() - started) / len(trace) * 1e6,
    }


def _capacity_blocks(gib: float, shape: str) -> int:
    """Blocks of KV a node holds in `gib` GiB (0: unlimited)."""
    if gib <= 0:
        return 1 << 62
    return int(gib * 2**30 // (SHAPES[shape].kv_bytes_per_token * TRACE_BLOCK_TOKENS))


def run(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    trace = load_trace(Path(args.trace), args.limit)
    shape = SHAPES[args.shape]
    best = ideal(trace)
    balance = Balance(args.balance_abs, args.balance_rel)
    sweeps: list[dict[str, Any]] = []
    for gib in args.capacity_gib:
        cap = _capacity_blocks(gib, args.shape)
        results = [
            simulate(trace, p, args.nodes, cap, args.decode_s, args.shape, balance, args.seed)
            for p in Policy
        ]
        shared = ideal(trace, 0 if gib <= 0 else cap * args.nodes)
        sweeps.append(
            {"capacity_gib": gib, "capacity_blocks": cap, "shared_lru": shared, "results": results}
        )
    head["wall_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    targets = []
    for sw in sweeps:
        aff = next(r for r in sw["results"] if r["policy"] == Policy.AFFINITY.value)
        label = "unlimited" if sw["capacity_gib"] <= 0 else f"{sw['capacity_gib']:g} GiB/node"
        targets += [
            report.at_least(
                f"affinity_over_ideal_{sw['capacity_gib']:g}",
                f"{label}: affinity hit rate / ideal (infinite shared cache)",
                aff["hit_rate"] / best if best else None,
                TARGET_HIT_RATIO,
                "",
            ),
            report.at_most(
                f"affinity_busiest_over_mean_{sw['capacity_gib']:g}",
                f"{label}: affinity busiest node's requests / mean",
                aff["busiest_over_mean_requests"],
                TARGET_LOAD_RATIO,
                "x",
            ),
        ]
    parts = [
        "# kvdir bench routing",
        report.header_markdown(head),
        __doc__ or "",
        f"Trace `{args.trace}`: {len(trace):,} requests, "
        f"{sum(r.input_tokens for r in trace):,} prompt tokens, "
        f"{len({b for r in trace for b in r.blocks}):,} distinct 512-token blocks. "
        f"{args.nodes} nodes; shape {shape.name} ({shape.kv_bytes_per_token // 1024} KiB of KV "
        f"per token); decode {args.decode_s * 1000:g} ms per output token; balance guard abs "
        f"{balance.abs_load:g}, rel {balance.rel_load:g}; seed {args.seed}. "
        f"**Ideal hit rate (infinite shared cache): {best:.3f}.**",
        report.targets_table(targets),
    ]
    for sw in sweeps:
        label = (
            "unlimited capacity per node"
            if sw["capacity_gib"] <= 0
            else f"{sw['capacity_gib']:g} GiB of KV per node ({sw['capacity_blocks']:,} blocks)"
        )
        rows = [
            (
                r["policy"],
                f"{r['hit_rate']:.3f}",
                f"{r['hit_rate'] / best:.3f}" if best else "-",
                f"{r['pulled_share']:.3f}",
                f"{r['busiest_over_mean_requests']:.2f}x",
                f"{r['busiest_over_mean_prefill']:.2f}x",
                ", ".join(f"{k} {v}" for k, v in sorted(r["rules"].items())),
                f"{r['decide_us_per_request']:.0f}",
            )
            for r in sw["results"]
        ]
        parts.append(
            f"## {label}\n\nOne LRU shared by all nodes with their total capacity would hit "
            f"{sw['shared_lru']:.3f} ({sw['shared_lru'] / best:.3f} of the ideal).\n\n"
            + report.table(
                rows,
                [
                    "Policy",
                    "Hit rate",
                    "/ ideal",
                    "of it pulled",
                    "Busiest / mean requests",
                    "Busiest / mean prefill tokens",
                    "Rules",
                    "us per decision",
                ],
            )
        )
    md = "\n\n".join(parts) + "\n"
    stem = f"routing-{started:%Y-%m-%d}"
    data = {
        "header": head,
        "ideal_hit_rate": best,
        "targets": [t.as_dict() for t in targets],
        "sweeps": sweeps,
    }
    md_path, js_path = report.write(Path(args.out), stem, md, data)
    print(md)
    print(f"wrote {md_path} and {js_path}")
    return 0


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "routing",
        help="routing policies replayed over a request trace (hit rate vs ideal, balance)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    p.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument(
        "--capacity-gib",
        type=float,
        nargs="+",
        default=[0.0, 512.0, 60.0],
        help="KV cache per node, GiB (one run each; 0: unlimited)",
    )
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--decode-s", type=float, default=0.02, help="seconds per output token")
    p.add_argument("--balance-abs", type=float, default=Balance().abs_load)
    p.add_argument("--balance-rel", type=float, default=Balance().rel_load)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    p.set_defaults(func=run)
