"""`kvdir bench vllm --device cuda`: kvdir's connector inside real vLLM engines on one GPU.

Needs a CUDA GPU, CuPy and vLLM 0.24 (the H200 bundle: ../shared/notes/vllm-gpu.md).
Three parts, one after another, each with its own cluster (`--only` picks some):

8b (four engines, bench/vllm/gpu_nodes.py): a 3-replica directory, agents with
GPU-tier pools, engines a (holder), b (pulls over CUDA IPC), c (pulls over the host
path) and n (no connector), all on 127.0.0.1. Checks first, each recorded with what
it saw (a failed check fails the run):
- ipc / host: a computes an 8k-token prompt P; b (CUDA IPC) and c (host path) serve
  P + a new turn: vLLM reports P's full blocks cached, kvdir's load counters name
  the path, and the greedy 64-token answer equals n's recompute;
- tenants: a prefix computed under one cache_salt is never loaded under another;
- reuse: a's slot reused between b's data read and its header read: fewer blocks
  load, the rest is recomputed, same answer, the validation miss counted;
after the measurements (they need a alive): agent a killed during b's load, then
the directory down: b recomputes, same answer, within a bound.
Then per prefix length: turn-2 TTFT on the same prompt and turn, side by side:
n recomputes; b pulls over CUDA IPC; c pulls over the host path; b again, served
from vLLM's own prefix cache (the floor); a's prefill with the connector saving
next to n's plain prefill of a same-length prompt; the connector's load seconds
next to a bare device copy of the same bytes (CUDA IPC) and the agent's bare
fetch of them (host path). One TTFT is one `LLM.generate` of one output token.

70b and peer (two engines of the 70B shape cut to 20 layers, bench/vllm/gpu_two.py):
b's pull over CUDA IPC against b's own recompute and local hit at 8k tokens; then
vLLM's OffloadingConnector reloading an engine's own prefix from its CPU tier next
to kvdir's connector reloading it from the engine's own pool.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.vllm import gpu_two
from bench.vllm.gpu_args import add_arguments, parts_of
from bench.vllm.gpu_calls import (
    ANSWER_TOKENS,
    HASH_SEED,
    TURN_TOKENS,
    EngineCalls,
    bare_copy_s,
    keys,
    parse_loads,
    parse_timelines,
    prompt,
)
from bench.vllm.gpu_nodes import BLOCK_TOKENS, SHAPES, GpuNodes, gpu_nodes
from bench.vllm.gpu_pair import drop_pools
from bench.vllm.gpu_report import write_results
from kvdir import report
from kvdir.local import ClusterError, wait_agent_sees

DEFAULT_TOKENS = (1024, 4096, 8192)
CHECK_TOKENS = 8192
FALLBACK_S_MAX = 30.0


class Bench(EngineCalls):
    """The four-engine part's checks and measurements (engines a, b, c, n)."""

    def __init__(self, n: GpuNodes) -> None:
        super().__init__(n.engines, n.shape.vocab)
        self.n = n

    def a_holds(self, tokens: list[int], salt: str | None = None) -> None:
        """Wait until agents b and c see a holding every full block of `tokens`."""
        chain = keys(tokens, salt)
        blocks = len(tokens) // BLOCK_TOKENS
        ns = self.n.shape.ns()
        for sock in (self.n.socket("b"), self.n.socket("c")):
            wait_agent_sees(sock, ns, chain, "a", blocks, timeout_s=60.0)

    # ------------------------------------------------------------- checks

    def pulled(self, puller: str, seed: int, source: str) -> dict[str, Any]:
        p = prompt(seed, CHECK_TOKENS, self.vocab)
        turn = p + prompt(seed + 1, TURN_TOKENS, self.vocab)
        if puller == "b":  # c's check reuses b's prompt: a (and now b) hold it
            self.gen("a", p)
            self.a_holds(p)
        self.new_loads(puller)
        got = self.gen(puller, turn, ANSWER_TOKENS)
        loads = self.new_loads(puller)
        ref = self.gen("n", turn, ANSWER_TOKENS)
        blocks = CHECK_TOKENS // BLOCK_TOKENS
        return {
            "ok": got["tokens"] == ref["tokens"]
            and got["cached"] >= CHECK_TOKENS
            and len(loads) == 1
            and loads[0]["transport"] == source
            and loads[0]["peer"] >= blocks  # c may read b, which also holds the turn's blocks
            and loads[0]["recomputed"] == 0,
            "cached": got["cached"],
            "same_tokens": got["tokens"] == ref["tokens"],
            "loads": loads,
        }

    def tenants(self) -> dict[str, Any]:
        p = prompt(11, 2048, self.vocab)
        turn = p + prompt(12, TURN_TOKENS, self.vocab)
        self.gen("a", p, cache_salt="tenant-1")
        self.a_holds(p, "tenant-1")
        other = self.gen("b", turn, ANSWER_TOKENS, cache_salt="tenant-2")
        same = self.gen("b", turn, ANSWER_TOKENS, cache_salt="tenant-1")
        return {
            "ok": other["cached"] == 0
            and same["cached"] >= 2048
            and other["tokens"] == same["tokens"],
            "other_tenant_cached": other["cached"],
            "same_tenant_cached": same["cached"],
        }

    def reuse(self) -> dict[str, Any]:
        from kvdir.agent.engine.client import EngineClient

        p = prompt(21, 4096, self.vocab)
        turn = p + prompt(22, TURN_TOKENS, self.vocab)
        self.gen("a", p)
        self.a_holds(p)
        chain, ns, j = keys(p), self.n.shape.ns(), 7
        client = EngineClient(self.n.socket("a"))
        fetcher = self.n.daemon_b.fetcher
        assert fetcher is not None
        fired: list[int] = []
        try:
            slots = list(client.lookup(ns, chain).local_slots)
            victim = slots[j]

            def reuse() -> None:
                if not fired:
                    fired.append(1)
                    client.removed(ns, [chain[j]], [victim])  # the generation moves first
                    client.slot_view(ns, victim)[:] = b"\xee" * self.n.shape.block_bytes

            misses = fetcher.validation_failures
            fetcher.after_data = reuse
            self.new_loads("b")
            try:
                got = self.gen("b", turn, ANSWER_TOKENS)
            finally:
                fetcher.after_data = None
            loads = self.new_loads("b")
        finally:
            client.close()
        ref = self.gen("n", turn, ANSWER_TOKENS)
        return {
            "ok": fired == [1]
            and fetcher.validation_failures == misses + 1
            and got["tokens"] == ref["tokens"]
            and len(loads) == 1
            and loads[0]["peer"] == j
            and loads[0]["recomputed"] == 4096 // BLOCK_TOKENS - j,
            "fired": fired,
            "validation_failures": fetcher.validation_failures - misses,
            "cached_reported_by_vllm": got["cached"],
            "same_tokens": got["tokens"] == ref["tokens"],
            "loads": loads,
        }

    def agent_killed(self) -> dict[str, Any]:
        p = prompt(31, 4096, self.vocab)
        turn = p + prompt(32, TURN_TOKENS, self.vocab)
        self.gen("a", p)
        self.a_holds(p)
        fetcher = self.n.daemon_b.fetcher
        assert fetcher is not None
        fired: list[int] = []

        def kill() -> None:
            if not fired:
                fired.append(1)
                self.n.agents["a"].kill(signal.SIGKILL)

        fetcher.after_data = kill
        t0 = time.monotonic()
        try:
            got = self.gen("b", turn, ANSWER_TOKENS)
        finally:
            fetcher.after_data = None
        took = time.monotonic() - t0
        ref = self.gen("n", turn, ANSWER_TOKENS)
        return {
            "ok": fired == [1] and took < FALLBACK_S_MAX and got["tokens"] == ref["tokens"],
            "fired": fired,
            "seconds_to_answer": round(took, 3),
            "cached": got["cached"],
        }

    def directory_down(self) -> dict[str, Any]:
        for r in list(self.n.cluster.replicas):
            self.n.cluster.kill(r)
        turn = prompt(41, 4096 + TURN_TOKENS, self.vocab)
        t0 = time.monotonic()
        got = self.gen("b", turn, ANSWER_TOKENS)
        took = time.monotonic() - t0
        ref = self.gen("n", turn, ANSWER_TOKENS)
        return {
            "ok": took < FALLBACK_S_MAX and got["cached"] == 0 and got["tokens"] == ref["tokens"],
            "seconds_to_answer": round(took, 3),
            "cached": got["cached"],
        }

    # -------------------------------------------------------- measurements

    def bare_fetch(self, tokens: list[int]) -> dict[str, Any]:
        """Agent c's own fetch of `tokens`' blocks (tcp into pinned host, one upload)."""
        from kvdir.agent.engine.client import EngineClient

        chain, ns = keys(tokens), self.n.shape.ns()
        client = EngineClient(self.n.socket("c"))
        try:
            slots = client.allocate(ns, len(chain), evict=True).slots
            t0 = time.perf_counter()
            r = client.fetch(ns, chain, slots, 30_000)
            took = time.perf_counter() - t0
            client.free(ns, slots)
        finally:
            client.close()
        return {"seconds": took, "bytes": int(r.bytes), "valid_blocks": int(r.valid_blocks),
                "transport": r.transport}  # fmt: skip

    def measure(self, tokens: int, seed: int) -> dict[str, Any]:
        v = self.vocab
        p = prompt(seed, tokens, v)
        turn = p + prompt(seed + 1, TURN_TOKENS, v)
        row: dict[str, Any] = {"tokens": tokens}
        row["plain_prefill"] = self.gen("n", prompt(seed + 2, tokens, v))["seconds"]
        row["saving_prefill"] = self.gen("a", p)["seconds"]
        self.a_holds(p)
        row["bare_fetch"] = self.bare_fetch(p)
        rec = self.gen("n", turn)
        row["recompute"] = rec["seconds"]
        row["floor_plain"] = self.gen("n", turn)["seconds"]  # vLLM's own hit, no connector
        for name, path in (("b", "ipc"), ("c", "host")):
            self.new_loads(name)
            got = self.gen(name, turn)
            text = self.new_log(name)
            loads = parse_loads(text)
            row[path] = {
                "ttft": got["seconds"],
                "cached": got["cached"],
                "same_first_token": got["tokens"] == rec["tokens"],
                "loaded_bytes": {ld["transport"]: ld["bytes"] for ld in loads if ld["peer"]},
                "load_s": sum(ld["ms"] for ld in loads) / 1e3,
                "loads": loads,
                "timelines": parse_timelines(text),
            }
        floor = self.gen("b", turn)
        row["floor"] = floor["seconds"]
        row["floor_cached"] = floor["cached"]
        nbytes = (len(p) // BLOCK_TOKENS) * self.n.shape.block_bytes
        row["bare_copy_s"] = bare_copy_s(nbytes)
        row["bytes"] = nbytes
        print(f"==> {tokens} tokens: {row}", flush=True)
        return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Callable[[dict[str, Any]], float]) -> float:
        return float(statistics.median(get(r) for r in rows))

    s: dict[str, Any] = {"tokens": rows[0]["tokens"], "repeats": len(rows)}
    s["recompute_s"] = med(lambda r: r["recompute"])
    s["floor_s"] = med(lambda r: r["floor"])
    s["floor_plain_s"] = med(lambda r: r.get("floor_plain", float("nan")))
    s["ipc_path"] = _path_medians([r["ipc"] for r in rows])
    s["ipc_s"] = med(lambda r: r["ipc"]["ttft"])
    s["host_s"] = med(lambda r: r["host"]["ttft"])
    s["ipc_load_s"] = med(lambda r: r["ipc"]["load_s"])
    s["host_load_s"] = med(lambda r: r["host"]["load_s"])
    s["bare_copy_s"] = med(lambda r: r["bare_copy_s"])
    s["bare_fetch_s"] = med(lambda r: r["bare_fetch"]["seconds"])
    s["bytes"] = rows[0]["bytes"]
    s["saving_prefill_s"] = med(lambda r: r["saving_prefill"])
    s["plain_prefill_s"] = med(lambda r: r["plain_prefill"])
    s["save_overhead"] = s["saving_prefill_s"] / s["plain_prefill_s"] - 1
    s["ipc_vs_floor"] = s["ipc_s"] / s["floor_s"]
    s["ipc_load_vs_copy"] = s["ipc_load_s"] / s["bare_copy_s"] if s["bare_copy_s"] else 0.0
    s["host_load_vs_bare"] = s["bare_fetch_s"] / s["host_load_s"] if s["host_load_s"] else 0.0
    s["cached_min"] = min(min(r["ipc"]["cached"], r["host"]["cached"]) for r in rows)
    s["sources"] = sorted({k for r in rows for p in ("ipc", "host") for k in r[p]["loaded_bytes"]})
    s["correct"] = all(r[p]["same_first_token"] for r in rows for p in ("ipc", "host"))
    return s


def _path_medians(pulls: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians of where one path's pulled requests spent their time (the scheduler
    side's timeline line, the worker's load line); None where no run logged one."""
    lines = [p["timelines"][0] for p in pulls if p.get("timelines")]
    loads = [p["loads"][0] for p in pulls if p.get("loads")]

    def med(vals: list[Any]) -> float | None:
        got = [float(v) for v in vals if v is not None]
        return float(statistics.median(got)) if got else None

    return {
        "lookup_ms": med([t["lookup_ms"] for t in lines]),
        "thread_ms": med([t.get("thread_ms") for t in lines]),
        "agent_call_ms": med([t.get("agent_call_ms") for t in lines]),
        "taken_ms": med([t.get("taken_ms") for t in lines]),
        "calls": med([t["calls"] for t in lines]),
        "load_ms": med([ld["ms"] for ld in loads]),
        "reported_ms": med([t["reported_ms"] for t in lines]),
        "forward_ms": med([t["forward_ms"] for t in lines]),
        "steps": med([t["steps"] for t in lines]),
        "total_ms": med([t["total_ms"] for t in lines]),
    }


def run_8b(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """The four-engine part (8B shape): checks, then turn-2 TTFT per prefix length."""
    shape = SHAPES["8b"]
    max_len = max(args.tokens) + TURN_TOKENS + 4 * BLOCK_TOKENS
    max_len = max(max_len, CHECK_TOKENS + TURN_TOKENS + 4 * BLOCK_TOKENS)
    raw: dict[int, list[dict[str, Any]]] = {t: [] for t in args.tokens}
    t0 = time.monotonic()
    extra = {"async_scheduling": False} if args.no_async_scheduling else None
    with gpu_nodes(tmp, shape, max_len, args.pool_slots, args.memory_share, extra) as n:
        b = Bench(n)
        b.gen("n", prompt(1, 256, shape.vocab))  # warm every engine once
        for name in ("a", "b", "c"):
            b.gen(name, prompt(2, 256, shape.vocab))
        if not args.skip_checks:
            b.check("ipc", lambda: b.pulled("b", 100, "cuda"))
            b.check("host", lambda: b.pulled("c", 100, "tcp"))
            b.check("tenants", b.tenants)
            b.check("reuse", b.reuse)
        seed = 1000
        for rep in range(args.repeats):
            for tokens in args.tokens:
                with contextlib.suppress(ClusterError):
                    raw[tokens].append(b.measure(tokens, seed))
                seed += 10
            print(f"==> repeat {rep + 1} done", flush=True)
        if not args.skip_checks:
            b.check("agent_killed", b.agent_killed)
            b.check("directory_down", b.directory_down)
    drop_pools(tmp)
    summary = [summarize(rows) for rows in raw.values() if rows]
    return {"shape": shape.describe(), "summary": summary, "raw": raw, "checks": b.checks,
            "seconds": time.monotonic() - t0}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parts = parts_of(args)
    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    try:
        import vllm

        head["vllm"] = vllm.__version__
    except ImportError:
        print("kvdir bench vllm --device cuda: vLLM is not importable here", file=sys.stderr)
        return 2
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    if args.work_dir:  # kept: its logs are the record of a device run
        os.makedirs(args.work_dir, exist_ok=True)
        base_ctx: Any = contextlib.nullcontext(args.work_dir)
    else:
        # Pools in memory: a file-backed mapping cannot be page-locked for the GPU.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        base_ctx = tempfile.TemporaryDirectory(prefix="kvdir-bench-gpu-", dir=shm)
    four: dict[str, Any] = {"shape": SHAPES["8b"].describe(), "summary": [], "raw": {},
                            "checks": []}  # fmt: skip
    two: dict[str, Any] | None = None
    with base_ctx as tmp:
        if "8b" in parts:
            try:
                four = run_8b(args, tmp)
            except Exception as e:  # the two-engine parts still run
                four["error"] = f"{type(e).__name__}: {e}"
                print(f"==> 8b part failed: {four['error']}", flush=True)
            write_results(args, parts, started, head, four, None, final=False)
        if "70b" in parts or "peer" in parts:
            two = gpu_two.run_two(args, tmp, tuple(p for p in parts if p != "8b"))
    write_results(args, parts, started, head, four, two, final=True)
    failed = [c["check"] for c in four["checks"] if not c["ok"]]
    failed += ["error:8b"] if "error" in four else []
    failed += gpu_two.failed(two) if two is not None else []
    wrong = not all(s["correct"] for s in four["summary"])
    if failed:
        print(f"kvdir bench vllm --device cuda: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or wrong else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.gpu", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
