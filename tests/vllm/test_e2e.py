"""Two real vLLM engines on two kvdir nodes: B loads A's prefixes through kvdir.

Node A: a `kvdir agent serve` process and an engine. Node B: an AgentDaemon
in this process (real Unix socket, real TCP port, tcp transport only, so its
fetch hook can make a reuse or a peer death race a read) and an engine: the
session's `pair` (conftest.py), which test_lora shares, so every test uses its
own prompts and reads counters as differences. The destructive tests (peer
killed, directory down, agent down) run last, in that order, and this module
after the tier's others. The reference for "identical output" is engine A computing the
whole prompt itself: a fresh cache_salt matches nothing, and a salt changes
only the block hashes, never the computation.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.local import wait_agent_sees
from tests.vllm.conftest import Pair
from tests.vllm.engines import Engine
from tests.vllm.helpers import NS, held, keys, metric, prompt, wait_held
from tests.vllm.model import BLOCK_BYTES, BLOCK_TOKENS, MODEL_NAME

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOGPROB_TOL = 0.05
"""bf16 KV: a loaded prefix and a recomputed one may differ in the last bits."""
FALLBACK_S_MAX = 30.0
"""A request whose load cannot happen still answers within this (recompute included)."""
PROMPT_TOKENS = 1600
TURN_TOKENS = 100
OUT_TOKENS = 16


def one_shot(pair: Pair, action: Callable[[], None]) -> list[int]:
    """Run `action` between B's next fetch's data read and its header read."""
    fetcher = pair.daemon_b.fetcher
    assert fetcher is not None
    fired: list[int] = []

    def hook() -> None:
        if not fired:
            fired.append(1)
            action()

    fetcher.after_data = hook
    return fired


def out(engine: Engine, tokens: list[int], **kw: Any) -> dict[str, Any]:
    kw.setdefault("max_tokens", OUT_TOKENS)
    return dict(engine.generate([tokens], logprobs=True, **kw)["outputs"][0])


def reference(pair: Pair, tokens: list[int], salt: str) -> dict[str, Any]:
    ref = out(pair.engines["a"], tokens, cache_salt=salt)
    assert ref["cached"] == 0
    return ref


def same_answer(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["tokens"] == ref["tokens"]
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], ref["logprobs"], strict=True)]
    assert max(diffs) <= LOGPROB_TOL, max(diffs)


def a_computes(pair: Pair, seed: int, salt: str | None = None) -> tuple[list[int], list[int]]:
    """A computes a fresh prompt P; returns (P, P + a new turn) once A's blocks are published."""
    p = prompt(seed, PROMPT_TOKENS)
    assert out(pair.engines["a"], p, max_tokens=4, cache_salt=salt)["cached"] == 0
    wait_held(pair.cluster, p, "a", PROMPT_TOKENS // BLOCK_TOKENS, salt)
    socket_b = pair.daemon_b.cfg.engine_socket  # B's agent reads its own mirror
    wait_agent_sees(socket_b, NS, keys(p, salt), "a", PROMPT_TOKENS // BLOCK_TOKENS)
    return p, p + prompt(seed + 1, TURN_TOKENS)


FULL = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.timeout(1500)
def test_b_loads_a_prefix_and_answers_identically(pair: Pair) -> None:
    _, turn = a_computes(pair, 1)
    before = pair.engines["b"].metrics()
    got = out(pair.engines["b"], turn)
    after = pair.engines["b"].metrics()

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert got["cached"] == FULL
    assert grew("vllm:external_prefix_cache_hits") >= FULL
    p2p = f"vllm:prompt_tokens_cached_by_source{{model_name={MODEL_NAME},source=p2p}}"
    assert grew(p2p) >= FULL
    same_answer(got, reference(pair, turn, "ref-1"))
    # The fetched blocks stay in B's pool and are published: B is now a holder too.
    wait_held(pair.cluster, turn, "b", FULL // BLOCK_TOKENS)


@pytest.mark.timeout(600)
def test_tenants_with_different_cache_salts_never_share_a_block(pair: Pair) -> None:
    p, turn = a_computes(pair, 11, salt="tenant-1")
    assert not held(pair.cluster, p)  # unsalted keys: nobody
    other = out(pair.engines["b"], turn, cache_salt="tenant-2")
    assert other["cached"] == 0
    same = out(pair.engines["b"], turn, cache_salt="tenant-1")
    assert same["cached"] == FULL  # the owner's own tenant does load it
    same_answer(other, same)


@pytest.mark.timeout(600)
def test_a_slot_reused_during_the_read_is_recomputed(pair: Pair) -> None:
    p, turn = a_computes(pair, 21)
    j = 7
    a_client = EngineClient(pair.agent_a.engine_socket)
    try:
        slots = list(a_client.lookup(NS, keys(p)).local_slots)
        assert len(slots) == PROMPT_TOKENS // BLOCK_TOKENS
        victim = slots[j]

        def reuse() -> None:
            a_client.removed(NS, [keys(p)[j]], [victim])  # bumps the generation first
            a_client.slot_view(NS, victim)[:] = b"\xee" * BLOCK_BYTES

        fetcher = pair.daemon_b.fetcher
        assert fetcher is not None
        misses = fetcher.validation_failures
        fired = one_shot(pair, reuse)
        try:
            got = out(pair.engines["b"], turn)
        finally:
            fetcher.after_data = None
    finally:
        a_client.close()
    assert fired == [1]
    assert fetcher.validation_failures == misses + 1
    same_answer(got, reference(pair, turn, "ref-21"))


@pytest.mark.timeout(600)
def test_peer_killed_mid_transfer_falls_back_to_recompute(pair: Pair) -> None:
    _, turn = a_computes(pair, 31)
    fired = one_shot(pair, lambda: pair.agent_a.kill(signal.SIGKILL))
    t0 = time.monotonic()
    try:
        got = out(pair.engines["b"], turn)
    finally:
        assert pair.daemon_b.fetcher is not None
        pair.daemon_b.fetcher.after_data = None
    assert time.monotonic() - t0 < FALLBACK_S_MAX
    assert fired == [1]
    same_answer(got, reference(pair, turn, "ref-31"))


@pytest.mark.timeout(600)
def test_directory_down_means_local_recompute(pair: Pair) -> None:
    for r in list(pair.cluster.replicas):
        pair.cluster.kill(r)
    turn = prompt(41, PROMPT_TOKENS + TURN_TOKENS)
    t0 = time.monotonic()
    got = out(pair.engines["b"], turn)
    assert time.monotonic() - t0 < FALLBACK_S_MAX
    assert got["cached"] == 0
    same_answer(got, reference(pair, turn, "ref-41"))


@pytest.mark.timeout(600)
def test_agent_down_means_local_recompute(pair: Pair) -> None:
    pair.daemon_b.stop(deregister=False)
    pair.b_stopped = True
    turn = prompt(51, PROMPT_TOKENS + TURN_TOKENS)
    t0 = time.monotonic()
    got = out(pair.engines["b"], turn)
    assert time.monotonic() - t0 < FALLBACK_S_MAX
    assert got["cached"] == 0
    same_answer(got, reference(pair, turn, "ref-51"))
