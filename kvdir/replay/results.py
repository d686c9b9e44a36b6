"""Per-scenario figures of a replay, the Markdown tables and the targets.

Definitions (docs/replay.md):
- reusable blocks of a request: its leading blocks that appeared in any
  earlier request (what an infinite global cache would serve);
- hit rate: blocks served from cache (local or pulled) over reusable blocks;
- wasted prefill: GPU prefill seconds spent recomputing reusable blocks, over
  all prefill seconds;
- throughput: output tokens per second the cluster sustains when every GPU is
  busy: output tokens * GPUs / GPU-busy seconds (prefill, transfer stalls and
  each request's decode share), so it does not depend on the arrival rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvdir.replay.gpu import GpuModel
from kvdir.replay.sim import IDEAL, SCENARIOS, Outcome
from kvdir.replay.trace import Request
from kvdir.report import Target, at_most, fmt, percentile, table

TURNS_SHOWN = 6
"""Turns 1..5 separately, then 6 and later together."""
HIT_GAP_MAX = 0.05
"""Pool scenarios under random routing: hit rate within 5 points of the ideal row."""


def turn_bucket(turn: int) -> str:
    return str(turn) if turn < TURNS_SHOWN else f"{TURNS_SHOWN}+"


def summarize(o: Outcome, gpu: GpuModel, gpus: int) -> dict[str, Any]:
    s = o.served
    reusable = sum(x.reusable for x in s)
    hits = sum(min(x.local + x.pulled, x.reusable) for x in s)
    ttft = sorted(x.ttft_s for x in s)
    prefill = sum(x.prefill_s for x in s)
    by_turn: dict[str, list[float]] = {}
    for x in s:
        by_turn.setdefault(turn_bucket(x.turn), []).append(x.ttft_s)
    scenario = SCENARIOS.get(o.scenario, IDEAL)
    moved = sum(p.moved_blocks for p in o.pulls)
    real_bytes = sum(p.real_bytes for p in o.pulls)
    real_s = sum(p.real_seconds for p in o.pulls)
    busy = sum(o.busy_s)
    return {
        "scenario": o.scenario,
        "label": scenario.label,
        "timing_link": scenario.link,
        "modelled_link": scenario.modelled,
        "requests": len(s),
        "blocks": sum(x.blocks for x in s),
        "reusable_blocks": reusable,
        "hit_blocks": hits,
        "local_blocks": sum(x.local for x in s),
        "pulled_blocks": sum(x.pulled for x in s),
        "hit_rate": hits / reusable if reusable else 0.0,
        "bytes_moved_model": moved * gpu.cost.block_bytes(),
        "per_128mb_s": gpu.per_128mb_s(scenario.link),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_by_turn_mean_s": {
            k: statistics.fmean(v) for k, v in sorted(by_turn.items(), key=lambda kv: kv[0])
        },
        "requests_by_turn": {k: len(v) for k, v in sorted(by_turn.items())},
        "throughput_tok_s": sum(x.output_tokens for x in s) * gpus / busy if busy else 0.0,
        "prefill_gpu_s": prefill,
        "wasted_prefill_fraction": sum(x.wasted_s for x in s) / prefill if prefill else 0.0,
        "real": {
            "fetches": len(o.pulls),
            "bytes": real_bytes,
            "seconds": real_s,
            "fetch_median_s": statistics.median(p.real_seconds for p in o.pulls)
            if real_bytes
            else None,
            "transports": sorted({p.transport for p in o.pulls if p.transport}),
            "invalidated_blocks": sum(p.invalidated for p in o.pulls),
            "wrong_blocks": sum(p.wrong_blocks for p in o.pulls),
            "model_mismatches": o.model_mismatches,
        },
        "ttft_sorted_s": ttft,
    }


def expected_local_hit_rate(
    requests: Sequence[Request], reusable: Sequence[int], nodes: int
) -> float:
    """Local-only hit rate that uniform 1/N routing gives with unbounded per-node caches.

    A reusable block that `m` earlier requests carried is on the chosen node
    with probability 1 - (1 - 1/N)^m (each of them went to a uniform node).
    """
    seen: dict[int, int] = {}
    num = 0.0
    for r, k in zip(requests, reusable, strict=True):
        for b in r.hash_ids[:k]:
            num += 1 - (1 - 1 / nodes) ** seen[b]
        for b in r.hash_ids:
            seen[b] = seen.get(b, 0) + 1
    total = sum(reusable)
    return num / total if total else 0.0


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def main_table(rows: Sequence[dict[str, Any]]) -> str:
    head = [
        "scenario",
        "hit rate (reusable blocks)",
        "KV moved (model size)",
        "get 128 MB of KV",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "throughput (output tok/s)",
        "prefill wasted on recompute",
    ]
    out = []
    for r in rows:
        how = "recompute" if r["timing_link"] is None else f"{r['timing_link']}"
        out.append(
            (
                r["label"],
                _pct(r["hit_rate"]),
                f"{r['bytes_moved_model'] / 1e12:.2f} TB",
                f"{how} {r['per_128mb_s'] * 1e3:.2f} ms" if r["scenario"] != "ideal" else "-",
                f"{r['ttft_mean_s'] * 1e3:,.0f} ms",
                f"{r['ttft_p50_s'] * 1e3:,.0f} ms",
                f"{r['ttft_p99_s'] * 1e3:,.0f} ms",
                f"{r['throughput_tok_s']:,.0f}",
                _pct(r["wasted_prefill_fraction"]),
            )
        )
    return table(out, head)


def turn_table(rows: Sequence[dict[str, Any]]) -> str:
    turns = list(rows[0]["ttft_by_turn_mean_s"]) if rows else []
    counts = rows[0]["requests_by_turn"] if rows else {}
    head = ["scenario", *(f"turn {t} ({counts[t]:,} req)" for t in turns)]
    out = [
        (r["scenario"], *(f"{r['ttft_by_turn_mean_s'].get(t, 0.0) * 1e3:,.0f} ms" for t in turns))
        for r in rows
    ]
    return table(out, head)


def real_table(rows: Sequence[dict[str, Any]]) -> str:
    head = [
        "scenario",
        "fetches",
        "real bytes moved",
        "transport",
        "median fetch (RPC-bound: scaled blocks)",
        "blocks refused by validation",
        "wrong bytes delivered",
        "model vs pool disagreements",
    ]
    out = []
    for r in rows:
        x = r["real"]
        per = x["fetch_median_s"]
        out.append(
            (
                r["scenario"],
                x["fetches"],
                f"{x['bytes'] / 2**20:,.1f} MiB",
                ",".join(x["transports"]) or "-",
                "-" if per is None else f"{per * 1e3:,.2f} ms",
                x["invalidated_blocks"],
                x["wrong_blocks"],
                x["model_mismatches"],
            )
        )
    return table(out, head)


def targets(rows: Sequence[dict[str, Any]], expected_a: float) -> list[Target]:
    by = {r["scenario"]: r for r in rows}
    out: list[Target] = []
    ideal = by.get("ideal")
    for key in ("B", "C", "C-rdma"):
        if key in by and ideal is not None:
            gap = ideal["hit_rate"] - by[key]["hit_rate"]
            out.append(
                at_most(f"hit_gap_{key}", f"{key}: hit rate below ideal", gap * 100, 5.0, "points")
            )
    if "A" in by:
        gap = abs(by["A"]["hit_rate"] - expected_a)
        out.append(
            at_most(
                "a_vs_expected",
                f"A: hit rate vs 1/N expectation ({_pct(expected_a)})",
                gap * 100,
                5.0,
                "points",
            )
        )
    for c in ("C-rdma", "C"):
        if "D" in by and c in by:
            ratio = by[c]["ttft_p99_s"] / by["D"]["ttft_p99_s"]
            name = f"TTFT p99: {c} / D (D better: > 1)"
            out.append(Target(f"d_p99_vs_{c}", name, "> 1 x", ratio, "x", ratio > 1.0))
    pulled = [r for r in rows if r["real"]["fetches"]]
    wrong = sum(r["real"]["wrong_blocks"] for r in pulled)
    out.append(
        at_most(
            "wrong_blocks", "wrong blocks delivered (validated reads)", float(wrong), 0.0, "blocks"
        )
    )
    return out


__all__ = [
    "expected_local_hit_rate",
    "fmt",
    "main_table",
    "real_table",
    "summarize",
    "targets",
    "turn_table",
]
