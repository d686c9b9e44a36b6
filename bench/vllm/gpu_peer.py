"""The GPU bench's peer part: vLLM's own OffloadingConnector (its CPU tier) next to
kvdir's connector, on the same shape, prompts and turn (bench/vllm/gpu_pair.py).

vLLM's offloading connector keeps what one engine computed in that engine's host
memory; it shares nothing between engines. So the fair comparison is one engine
reloading its own earlier prefix once vLLM's GPU prefix cache has lost it:

1. the engine computes P (its connector saves P's blocks: CPU tier / kvdir's pool);
2. it recomputes P + a new turn under a fresh cache_salt (the baseline; nothing
   cached, same work as a cold engine);
3. kvdir only: wait until a's pool holds P (saves are announced once copied);
4. its GPU prefix cache is reset (`LLM.reset_prefix_cache()`, the connector's store
   left alone);
5. P + the turn, timed: vLLM asks the connector, which loads P's blocks
   (OffloadingConnector: CPU -> GPU; kvdir on a CUDA engine: its GPU-tier pool ->
   vLLM's blocks, a device copy; a host-tier pool behind a CUDA engine is refused);
6. the same turn again: vLLM's own prefix hit (the floor).

The first token of 5 must equal that of 2; a check does the same with a 64-token
answer. o is engine "o" with the OffloadingConnector, a is kvdir's holder engine.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.vllm.gpu_70b import TOKENS, PairBench
from bench.vllm.gpu_calls import ANSWER_TOKENS, TURN_TOKENS
from bench.vllm.gpu_nodes import BLOCK_TOKENS
from bench.vllm.gpu_pair import PEER_CONNECTOR, PEER_CPU_BYTES
from kvdir import report

ROWS = {"a": "kvdir: a's own pool (GPU tier)", "o": f"vLLM {PEER_CONNECTOR}: o's CPU tier"}


def reload(pb: PairBench, name: str, seed: int, max_tokens: int = 1) -> dict[str, Any]:
    """Steps 1-6 on engine `name` ("a": kvdir, "o": the offloading connector)."""
    p, turn = pb.turn(seed)
    first = pb.gen(name, p)
    rec = pb.gen(name, turn, max_tokens, cache_salt=f"peer-recompute-{seed}")
    if name == "a":
        pb.pool_holds("a", p)
    pb.reset_prefix_cache(name)
    pb.new_loads(name)
    got = pb.gen(name, turn, max_tokens)
    loads = pb.new_loads(name)
    floor = pb.gen(name, turn, max_tokens)
    return {
        "tokens": TOKENS,
        "first_turn_s": first["seconds"],
        "recompute": rec["seconds"],
        "recompute_cached": rec["cached"],
        "reload": got["seconds"],
        "reload_cached": got["cached"],
        "floor": floor["seconds"],
        "floor_cached": floor["cached"],
        "same_first_token": got["tokens"][:1] == rec["tokens"][:1],
        "same_tokens": got["tokens"] == rec["tokens"],
        "loads": loads,
        "load_s": sum(ld["ms"] for ld in loads) / 1e3,
    }


def reload_check(pb: PairBench, name: str, seed: int) -> dict[str, Any]:
    r = reload(pb, name, seed, ANSWER_TOKENS)
    blocks = TOKENS // BLOCK_TOKENS
    from_pool = name != "a" or (
        len(r["loads"]) == 1 and r["loads"][0]["pool"] >= blocks and r["loads"][0]["peer"] == 0
    )
    ok = r["same_tokens"] and r["reload_cached"] >= TOKENS and r["recompute_cached"] == 0
    return {"ok": ok and from_pool, **{k: v for k, v in r.items() if k != "same_first_token"}}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Callable[[dict[str, Any]], float]) -> float:
        return float(statistics.median(get(r) for r in rows))

    return {
        "tokens": rows[0]["tokens"],
        "repeats": len(rows),
        "recompute_s": med(lambda r: r["recompute"]),
        "reload_s": med(lambda r: r["reload"]),
        "floor_s": med(lambda r: r["floor"]),
        "first_turn_s": med(lambda r: r["first_turn_s"]),
        "load_s": med(lambda r: r["load_s"]),
        "reload_vs_floor": med(lambda r: r["reload"]) / med(lambda r: r["floor"]),
        "cached_min": min(r["reload_cached"] for r in rows),
        "correct": all(r["same_first_token"] for r in rows),
    }


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def markdown(shape: str, summary: dict[str, dict[str, Any]], errors: dict[str, str]) -> list[str]:
    """The results' section: one row per connector, or why a row is missing."""
    out = [
        "## A peer's connector: an engine reloading its own prefix (median of repeats)",
        "",
        f"Model: {shape}, {TOKENS:,}-token prefix + a {TURN_TOKENS}-token turn. "
        "Each engine computes P, recomputes P + the turn under a fresh cache_salt (the "
        "baseline), loses P from vLLM's GPU prefix cache (`reset_prefix_cache()`, the "
        "connector's store kept), serves P + the turn from its connector (timed), then "
        "again from vLLM's own "
        f"prefix cache (the floor). vLLM's {PEER_CONNECTOR} shares nothing between "
        f"engines (its CPU tier is one engine's: {PEER_CPU_BYTES >> 30} GiB here); "
        "kvdir's pool on a CUDA engine is GPU tier (a host-tier pool behind a CUDA engine "
        "is refused), so its row is a device copy; kvdir's host path is the 8B table's "
        "pull over TCP. vLLM 0.24 runs Llama on its V2 model runner, which hands a "
        "connector per-layer caches (not the cross-layer blocks the OffloadingConnector "
        "prefers), so its loads copy layer by layer. LMCache is not measured: its compiled "
        "ops do not load on torch 2.11 (../shared/notes/vllm-gpu.md).",
        "",
    ]
    head = ["connector", "recompute ms", "reload from its tier ms", "local hit ms",
            "reload / local hit", "kvdir load ms", "first turn (saving) ms",
            "cached tokens (min)", "same first token"]  # fmt: skip
    rows = []
    for name, label in ROWS.items():
        s = summary.get(name)
        if s is None:
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", "not run"])
            continue
        rows.append([label, _ms(s["recompute_s"]), _ms(s["reload_s"]), _ms(s["floor_s"]),
                     f"{s['reload_vs_floor']:.2f}", _ms(s["load_s"]) if name == "a" else "-",
                     _ms(s["first_turn_s"]), s["cached_min"],
                     "yes" if s["correct"] else "NO"])  # fmt: skip
    out += [report.table(rows, head), ""]
    for name, err in errors.items():
        out += [f"{ROWS.get(name, name)}: could not run: `{err}`", ""]
    return out
