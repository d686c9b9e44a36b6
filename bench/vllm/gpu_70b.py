"""The GPU bench's two-engine part (bench/vllm/gpu_pair.py): turn-2 TTFT on engine b at
8k tokens of the 70B shape (20 layers), side by side: b's own recompute (a fresh
cache_salt: nothing to load, the connector still looks up and saves), b's pull of a's
prefix over CUDA IPC, and b's own local prefix hit (the same turn again). The host
path is not measured for this shape (no third engine fits); the 8B part has it.

The check `ipc_70b` first: a computes P, b serves P + a new turn with a 64-token greedy
answer, which must equal b's own recompute of it; the load came over CUDA IPC, whole.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.vllm.gpu_calls import (
    ANSWER_TOKENS,
    TURN_TOKENS,
    EngineCalls,
    bare_copy_s,
    keys,
    prompt,
)
from bench.vllm.gpu_nodes import BLOCK_TOKENS
from bench.vllm.gpu_pair import PairNodes
from kvdir import report
from kvdir.local import wait_agent_sees, wait_for

TOKENS = 8192
HOLD_TIMEOUT_S = 60.0
HOST_PATH_SKIPPED = (
    "The host path (a third engine pulling over TCP) is not measured for this shape: two "
    "engines of it fit on one H200, not three; the 8B table has it."
)


class PairBench(EngineCalls):
    def __init__(self, n: PairNodes) -> None:
        super().__init__(n.engines, n.shape.vocab)
        self.n = n

    def seen_by(self, puller: str, tokens: list[int], salt: str | None = None) -> None:
        """Wait until agent `puller` sees a holding every full block of `tokens`."""
        chain = keys(tokens, salt)
        ns = self.n.shape.ns()
        blocks = len(tokens) // BLOCK_TOKENS
        wait_agent_sees(self.n.socket(puller), ns, chain, "a", blocks, HOLD_TIMEOUT_S)

    def pool_holds(self, name: str, tokens: list[int]) -> None:
        """Wait until agent `name`'s own pool holds every full block of `tokens` (its
        engine's saves are announced once their copies are done)."""
        from kvdir.agent.engine.client import EngineClient, EngineError

        chain, ns = keys(tokens), self.n.shape.ns()
        blocks = len(tokens) // BLOCK_TOKENS
        client = EngineClient(self.n.socket(name), timeout_s=5.0)

        def held() -> bool:
            try:
                return client.lookup(ns, chain).local_blocks >= blocks
            except EngineError:  # a busy agent's slow answer: ask again
                return False

        try:
            wait_for(held, HOLD_TIMEOUT_S, f"agent {name}'s pool to hold {blocks} blocks")
        finally:
            client.close()

    def turn(self, seed: int) -> tuple[list[int], list[int]]:
        p = prompt(seed, TOKENS, self.vocab)
        return p, p + prompt(seed + 1, TURN_TOKENS, self.vocab)

    def ipc_check(self, seed: int) -> dict[str, Any]:
        p, turn = self.turn(seed)
        self.gen("a", p)
        self.seen_by("b", p)
        self.new_loads("b")
        got = self.gen("b", turn, ANSWER_TOKENS)
        loads = self.new_loads("b")
        ref = self.gen("b", turn, ANSWER_TOKENS, cache_salt=f"recompute-{seed}")
        blocks = TOKENS // BLOCK_TOKENS
        return {
            "ok": got["tokens"] == ref["tokens"]
            and got["cached"] >= TOKENS
            and ref["cached"] == 0
            and len(loads) == 1
            and loads[0]["transport"] == "cuda"
            and loads[0]["peer"] >= blocks
            and loads[0]["recomputed"] == 0,
            "cached": got["cached"],
            "recompute_cached": ref["cached"],
            "same_tokens": got["tokens"] == ref["tokens"],
            "loads": loads,
        }

    def measure(self, seed: int) -> dict[str, Any]:
        """One row: b pulls, then its local hit, then its recompute last (the
        recompute's own saves must not run beside the pull being timed)."""
        p, turn = self.turn(seed)
        row: dict[str, Any] = {"tokens": TOKENS}
        row["saving_prefill"] = self.gen("a", p)["seconds"]
        self.seen_by("b", p)
        self.new_loads("b")
        got = self.gen("b", turn)
        loads = self.new_loads("b")
        floor = self.gen("b", turn)
        rec = self.gen("b", turn, cache_salt=f"recompute-{seed}")
        row["recompute"] = rec["seconds"]
        row["recompute_cached"] = rec["cached"]
        row["ipc"] = {
            "ttft": got["seconds"],
            "cached": got["cached"],
            "same_first_token": got["tokens"] == rec["tokens"],
            "loaded_bytes": {ld["transport"]: ld["bytes"] for ld in loads if ld["peer"]},
            "load_s": sum(ld["ms"] for ld in loads) / 1e3,
            "loads": loads,
        }
        row["floor"] = floor["seconds"]
        row["floor_cached"] = floor["cached"]
        row["bytes"] = (len(p) // BLOCK_TOKENS) * self.n.shape.block_bytes
        row["bare_copy_s"] = bare_copy_s(row["bytes"])
        print(f"==> 70b {TOKENS} tokens: {row}", flush=True)
        return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Callable[[dict[str, Any]], float]) -> float:
        return float(statistics.median(get(r) for r in rows))

    s: dict[str, Any] = {"tokens": rows[0]["tokens"], "repeats": len(rows)}
    s["recompute_s"] = med(lambda r: r["recompute"])
    s["ipc_s"] = med(lambda r: r["ipc"]["ttft"])
    s["floor_s"] = med(lambda r: r["floor"])
    s["ipc_load_s"] = med(lambda r: r["ipc"]["load_s"])
    s["bare_copy_s"] = med(lambda r: r["bare_copy_s"])
    s["saving_prefill_s"] = med(lambda r: r["saving_prefill"])
    s["bytes"] = rows[0]["bytes"]
    s["ipc_vs_floor"] = s["ipc_s"] / s["floor_s"]
    s["ipc_load_vs_copy"] = s["ipc_load_s"] / s["bare_copy_s"] if s["bare_copy_s"] else 0.0
    s["cached_min"] = min(r["ipc"]["cached"] for r in rows)
    s["recompute_cached_max"] = max(r["recompute_cached"] for r in rows)
    s["sources"] = sorted({k for r in rows for k in r["ipc"]["loaded_bytes"]})
    s["correct"] = all(r["ipc"]["same_first_token"] for r in rows)
    return s


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def markdown(shape: str, summary: dict[str, Any] | None, error: str | None) -> list[str]:
    """The results' section for this part: its table, or why there is none."""
    out = ["## 70B shape (20 layers), two engines: turn-2 TTFT on b (median of repeats)", ""]
    out += [f"Model: {shape}.", ""]
    if error:
        out += [f"Not measured: `{error}`", ""]
    if summary is None:
        return out
    s = summary
    head = ["tokens", "recompute on b ms", "pull CUDA IPC ms", "pull host path ms",
            "local hit on b ms", "IPC / local hit", "IPC load ms", "bare D2D copy ms",
            "a's prefill, saving ms", "cached tokens (min)", "same first token"]  # fmt: skip
    row = [s["tokens"], _ms(s["recompute_s"]), _ms(s["ipc_s"]), "skipped", _ms(s["floor_s"]),
           f"{s['ipc_vs_floor']:.2f}", _ms(s["ipc_load_s"]), _ms(s["bare_copy_s"]),
           _ms(s["saving_prefill_s"]), s["cached_min"],
           "yes" if s["correct"] else "NO"]  # fmt: skip
    out += [report.table([row], head), ""]
    out += [
        f"Recompute is b itself under a fresh cache_salt ({s['recompute_cached_max']} tokens "
        "cached at most: none may be): it includes the connector's lookup miss and its "
        "saving. " + HOST_PATH_SKIPPED,
        "",
    ]
    return out
