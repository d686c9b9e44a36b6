"""Two real vLLM engines on two kvdir nodes: B loads A's prefix through kvdir.

A computes prompt P; B gets P + a new turn and must load P's full blocks
from A's pool (vLLM counts them as external hits) and answer exactly what an
engine that computed everything itself answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvdir.local import LocalAgent, LocalCluster
from tests.vllm.conftest import start_agent, start_engines
from tests.vllm.engines import Engine
from tests.vllm.helpers import metric, prompt, wait_held
from tests.vllm.model import BLOCK_TOKENS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOGPROB_TOL = 0.05
"""bf16 KV: a loaded prefix and a recomputed one may differ in the last bits."""


@dataclass
class Pair:
    agents: dict[str, LocalAgent]
    engines: dict[str, Engine]


@pytest.fixture(scope="module")
def pair(
    cluster: LocalCluster, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    base = str(tmp_path_factory.mktemp("nodes"))
    agents: dict[str, LocalAgent] = {}
    engines: dict[str, Engine] = {}
    try:
        for name in ("a", "b"):
            agents[name] = start_agent(cluster, base, name, "tcp,shm")
        engines = start_engines(base, model_dir, {n: a.engine_socket for n, a in agents.items()})
        yield Pair(agents, engines)
    finally:
        for e in engines.values():
            e.stop()
        for a in agents.values():
            a.stop()


@pytest.mark.timeout(1200)
def test_b_loads_a_prefix_and_answers_identically(cluster: LocalCluster, pair: Pair) -> None:
    a, b = pair.engines["a"], pair.engines["b"]
    p = prompt(1, 1600)
    turn = p + prompt(2, 100)
    first = a.generate([p], max_tokens=8)
    assert first["outputs"][0]["cached"] == 0
    wait_held(cluster, p, "a", len(p) // BLOCK_TOKENS)  # A's saves are published
    got = b.generate([turn], max_tokens=16, prompt_logprobs=True)["outputs"][0]
    after = b.metrics()
    # A reference that computed everything itself: a fresh cache_salt matches nothing.
    ref = a.generate([turn], max_tokens=16, prompt_logprobs=True, cache_salt="ref")["outputs"][0]
    assert ref["cached"] == 0
    full = len(p) // BLOCK_TOKENS * BLOCK_TOKENS
    assert got["cached"] == full, (
        got["cached"],
        full,
        {k: v for k, v in after.items() if "kvdir" in k or "external" in k},
    )
    hits = after["vllm:external_prefix_cache_hits"] - before.get(
        "vllm:external_prefix_cache_hits", 0
    )
    assert hits == full
    assert got["tokens"] == ref["tokens"]
    diffs = [
        abs(x - y)
        for x, y in zip(got["prompt_logprobs"], ref["prompt_logprobs"], strict=True)
        if x is not None and y is not None
    ]
    assert max(diffs) <= LOGPROB_TOL, max(diffs)
