"""One prompt length, measured on every engine of `nodes` in one pass.

Order, and why:
1. a computes prefix P (connector saving) and n computes another prompt of the
   same length (no connector): prefill with saving vs without.
2. Once the directory lists a as P's holder, b's and c's agents fetch P alone
   into scratch slots (freed, never announced): the bare transport, tcp and shm.
3. Turn 2 (P + new turn) on n (recompute), then c (pull over shm), then b (pull
   over tcp): TTFT, and the connector's own load seconds and bytes, so the load
   path's bytes/s sits next to the bare fetch of the same bytes.
TTFT is one generate call of one output token (the whole prefill plus the first
sample); every answer's token is checked against n's recompute.

Every timed step starts on a quiet machine (`wait_machine_quiet`): a vLLM CPU
worker busy-polls its message queue for a second after each step, so on a 2-core
host the engine that answered last would otherwise take a core from whatever is
measured next (the bare fetches ran beside one such spinner and the tcp pull
beside two: agent reads 6-8x slower in the pull than in the bare fetch of the
same bytes, 2026-12-05). The pulling engine's own polling during its load is
part of what is measured. Each wait is recorded; one that ran out is reported.
"""

from __future__ import annotations

import time
from typing import Any

from bench.host import wait_machine_quiet
from bench.vllm.engine import BenchEngine
from bench.vllm.model import BLOCK_TOKENS, Shape
from bench.vllm.nodes import LOAD_TIMEOUT_MS, Nodes
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import namespace
from kvdir.core.hashing import vllm_block_digests
from kvdir.local import wait_agent_sees, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.vllm.helpers import prompt

HELD_WAIT_S = 120.0
GENERATE_TIMEOUT_S = 900.0
"""A 4k prefill on a loaded 2-core host takes minutes; a hung engine still fails the run."""
LOGPROB_TOL = 0.1
"""bf16 KV through 8+ layers: a loaded prefix and a recomputed one differ in the last bits."""


def ns_of(shape: Shape) -> pb.Namespace:
    return namespace(shape.name, BLOCK_TOKENS, "bf16", shape.layout, 0, 1)


def _wait_held(nodes: Nodes, ns: pb.Namespace, chain: list[bytes], node: str) -> None:
    def held() -> bool:
        with nodes.cluster.client(timeout_s=5) as c:
            resp = c.lookup(ns, chain)
        return any(m.node_id == node and m.prefix_blocks >= len(chain) for m in resp.matches)

    wait_for(held, HELD_WAIT_S, f"{node} to hold {len(chain)} blocks", 0.05)


def _one(engine: BenchEngine, tokens: list[int]) -> dict[str, Any]:
    req = {"op": "generate", "prompts": [tokens], "max_tokens": 1, "logprobs": True}
    ans = engine.call(req, timeout_s=GENERATE_TIMEOUT_S)
    return {**ans["outputs"][0], "seconds": ans["seconds"]}


def bare_fetch(socket: str, ns: pb.Namespace, chain: list[bytes]) -> dict[str, Any]:
    """The agent's fetch of `chain` into scratch slots, timed from the engine's side."""
    client = EngineClient(socket, timeout_s=LOAD_TIMEOUT_MS / 1000)
    try:
        slots = client.allocate(ns, len(chain), evict=True).slots
        t0 = time.perf_counter()
        r = client.fetch(ns, chain, slots, LOAD_TIMEOUT_MS)
        wall = time.perf_counter() - t0
        client.free(ns, slots)
    finally:
        client.close()
    return {
        "transport": r.transport,
        "blocks": r.valid_blocks,
        "bytes": r.bytes,
        "seconds": wall,
        "agent_seconds": r.seconds,
    }


def _kvdir_counters(m: dict[str, float]) -> dict[str, float]:
    out = {"load_s": m.get("kvdir:load_seconds_sum", 0.0), "loads": 0.0}
    out["loads"] = m.get("kvdir:load_seconds_count", 0.0)
    for name in ("lookups", "lookup_timeouts", "agent_unavailable", "recomputed_blocks"):
        out[name] = sum(v for k, v in m.items() if k.startswith(f"kvdir:{name}_total"))
    for k, v in m.items():
        if k.startswith("kvdir:loaded_bytes_total{"):
            src = k.split("source=", 1)[1].split(",")[0].rstrip("}")
            out[f"bytes_{src}"] = out.get(f"bytes_{src}", 0.0) + v
    return out


def pulled(engine: BenchEngine, tokens: list[int]) -> dict[str, Any]:
    """Turn 2 on a connector engine, with the connector's load seconds and bytes for it."""
    before = _kvdir_counters(engine.metrics())
    got = _one(engine, tokens)
    after = _kvdir_counters(engine.metrics())
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    by_source = {k[6:]: v for k, v in delta.items() if k.startswith("bytes_") and v}
    counts = ("lookups", "lookup_timeouts", "agent_unavailable", "recomputed_blocks")
    return {
        **got,
        "load_s": delta["load_s"],
        "loads": delta["loads"],
        "loaded_bytes": by_source,
        "connector": {k: delta[k] for k in counts},
    }


def _agrees(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    diff = max(abs(x - y) for x, y in zip(got["logprobs"], ref["logprobs"], strict=True))
    return {"same_tokens": got["tokens"] == ref["tokens"], "logprob_diff": diff}


def measure(nodes: Nodes, shape: Shape, tokens: int, turn_tokens: int, seed: int) -> dict[str, Any]:
    e = nodes.engines
    ns = ns_of(shape)
    p, q, turn = prompt(seed, tokens), prompt(seed + 1, tokens), prompt(seed + 2, turn_tokens)
    chain = vllm_block_digests(p, BLOCK_TOKENS, "sha256")
    waits: list[float] = []

    def quiet() -> None:
        waits.append(wait_machine_quiet())

    quiet()
    saving = _one(e["a"], p)
    quiet()
    plain = _one(e["n"], q)
    _wait_held(nodes, ns, chain, "a")
    for reader in ("b", "c"):  # each agent reads its own mirror of the directory
        wait_agent_sees(nodes.agents[reader].engine_socket, ns, chain, "a", len(chain))
    bare = {}
    for transport, reader in (("tcp", "b"), ("shm", "c")):
        quiet()
        bare[transport] = bare_fetch(nodes.agents[reader].engine_socket, ns, chain)
    quiet()
    recompute = _one(e["n"], p + turn)
    quiet()
    shm = pulled(e["c"], p + turn)
    quiet()
    tcp = pulled(e["b"], p + turn)
    return {
        "tokens": tokens,
        "turn_tokens": turn_tokens,
        "prefill_saving_s": saving["seconds"],
        "prefill_plain_s": plain["seconds"],
        "bare": bare,
        "recompute": recompute,
        "pull": {"shm": shm, "tcp": tcp},
        "check": {"shm": _agrees(shm, recompute), "tcp": _agrees(tcp, recompute)},
        "quiet_waits_s": waits,
    }
