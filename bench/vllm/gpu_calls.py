"""What every part of the GPU bench does to its engines: prompts, their block keys,
one timed `generate`, the connector's load lines, a GPU prefix-cache reset, checks.

Importable without CUDA or vLLM (the unit tests use it with fake engines).
"""

from __future__ import annotations

import random
import re
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from bench.vllm.gpu_nodes import BLOCK_TOKENS, HASH_ALGO
from kvdir.core.hashing import vllm_block_digests, vllm_hash_fn, vllm_none_hash
from kvdir.local import wait_for

TURN_TOKENS = 64
ANSWER_TOKENS = 64
HASH_SEED = "0"
"""PYTHONHASHSEED of every engine (vLLM 0.24 seeds sha256 block hashes with it)."""
RESET_TIMEOUT_S = 30.0
"""vLLM refuses a prefix-cache reset while a finished request's blocks are still held
(a connector's last saves); they are let go within a few steps."""


class EngineLike(Protocol):
    """bench/vllm/gpu_nodes.py's GpuEngine as these helpers use it."""

    log_path: str

    def generate(self, prompts: list[list[int]], **kw: Any) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, float]: ...

    def reset_prefix_cache(self) -> bool: ...


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM 0.24's sha256 block hashes of `tokens` under PYTHONHASHSEED=HASH_SEED; a
    cache_salt is the first block's only extra key (0.24's kv_cache_utils)."""
    if not salt:
        return vllm_block_digests(tokens, BLOCK_TOKENS, HASH_ALGO, seed=HASH_SEED)
    first = tuple(tokens[:BLOCK_TOKENS])
    none = vllm_none_hash(HASH_ALGO, HASH_SEED)
    h0 = vllm_hash_fn(HASH_ALGO)((none, first, (salt,)))
    rest = vllm_block_digests(
        tokens[BLOCK_TOKENS:], BLOCK_TOKENS, HASH_ALGO, seed=HASH_SEED, parent=h0
    )
    return [h0, *rest]


LOAD_LINE = re.compile(
    r"kvdir load: request (?P<req>\S+), blocks (?P<start>\d+)\.\.(?P<end>\d+): "
    r"(?P<pool>\d+) from this node's pool, (?P<peer>\d+) from peers over (?P<transport>\S+) "
    r"\((?P<bytes>\d+) B\), (?P<recomputed>\d+) recomputed, (?P<ms>[\d.]+) ms "
    r"\(reserve (?P<reserve_ms>[\d.]+), fetch (?P<fetch_ms>[\d.]+) of which agent "
    r"(?P<agent_ms>[\d.]+) and read (?P<read_ms>[\d.]+), copy (?P<copy_ms>[\d.]+)\)"
)
"""The worker's line per load (agent/engine/vllm/worker.py): vLLM 0.24's offline engine
has no Prometheus registry for the connector's series, so the bench reads the log."""
TIMELINE_LINE = re.compile(
    r"kvdir timeline: request (?P<req>\S+): lookup settled (?P<lookup_ms>[\d.]+) ms over "
    r"(?P<calls>\d+) scheduler calls(?: \(thread \+(?P<thread_ms>[\d.]+) ms, agent call "
    r"(?P<agent_call_ms>[\d.]+) ms, taken \+(?P<taken_ms>[\d.]+) ms\))?; "
    r"load allocated \+(?P<allocated_ms>[\d.]+) ms; "
    r"(?:its end reported (?P<reported_ms>[\d.]+) ms and (?P<reported_steps>\d+) steps "
    r"after allocation; )?forward pass (?P<forward_ms>[\d.]+) ms and (?P<steps>\d+) steps "
    r"after allocation; (?P<total_ms>[\d.]+) ms after first seen"
)
"""The scheduler side's line per loaded request (agent/engine/vllm/scheduler.py): from
vLLM's first question about it to its first forward pass."""


def parse_loads(text: str) -> list[dict[str, Any]]:
    out = []
    for m in LOAD_LINE.finditer(text):
        d: dict[str, Any] = m.groupdict()
        for k in ("start", "end", "pool", "peer", "bytes", "recomputed"):
            d[k] = int(d[k])
        for k in ("ms", "reserve_ms", "fetch_ms", "agent_ms", "read_ms", "copy_ms"):
            d[k] = float(d[k])
        out.append(d)
    return out


def parse_timelines(text: str) -> list[dict[str, Any]]:
    out = []
    for m in TIMELINE_LINE.finditer(text):
        d: dict[str, Any] = {"req": m["req"]}
        for k in ("calls", "steps", "reported_steps"):
            d[k] = int(m[k]) if m[k] is not None else None
        for k in (
            "lookup_ms", "thread_ms", "agent_call_ms", "taken_ms",
            "allocated_ms", "reported_ms", "forward_ms", "total_ms",
        ):  # fmt: skip
            d[k] = float(m[k]) if m[k] is not None else None
        out.append(d)
    return out


def bare_copy_s(nbytes: int) -> float:
    """A device-to-device copy of `nbytes` in one call (the connector's floor)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    out = time.perf_counter() - t0
    del src, dst
    torch.cuda.empty_cache()
    return out


class EngineCalls:
    """Timed calls on named engines, their new load lines, and recorded checks."""

    def __init__(self, engines: Mapping[str, EngineLike], vocab: int) -> None:
        self.engines = engines
        self.vocab = vocab
        self.checks: list[dict[str, Any]] = []
        self._log_at: dict[str, int] = {}

    def new_log(self, name: str) -> str:
        """What engine `name` logged since the last call (its log is appended to)."""
        with open(self.engines[name].log_path, "rb") as f:
            f.seek(self._log_at.get(name, 0))
            text = f.read()
            self._log_at[name] = f.tell()
        return text.decode(errors="replace")

    def new_loads(self, name: str) -> list[dict[str, Any]]:
        """The loads engine `name` logged since the last call."""
        return parse_loads(self.new_log(name))

    def gen(self, name: str, tokens: list[int], max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
        r = self.engines[name].generate([tokens], max_tokens=max_tokens, **kw)
        out = dict(r["outputs"][0])
        out["seconds"] = float(r["seconds"])
        return out

    def metrics(self, name: str) -> dict[str, float]:
        return self.engines[name].metrics()

    def reset_prefix_cache(self, name: str, timeout_s: float = RESET_TIMEOUT_S) -> None:
        """Drop engine `name`'s GPU prefix cache (not its connector's store), asking
        again while vLLM still holds a finished request's blocks."""
        engine = self.engines[name]
        wait_for(engine.reset_prefix_cache, timeout_s, f"engine {name}'s prefix-cache reset")

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        try:
            seen = fn()
            ok = bool(seen.pop("ok"))
        except Exception as e:  # one failed check must not hide the others
            seen, ok = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, False
        seen.update(check=name, ok=ok, seconds=round(time.monotonic() - t0, 3))
        self.checks.append(seen)
        print(f"==> check {name}: {'ok' if ok else 'FAILED'} {seen}", flush=True)
