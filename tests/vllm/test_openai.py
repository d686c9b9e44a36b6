"""The OpenAI path: the `openai` client -> `kvdir gateway` (random routing) -> two `vllm serve`.

Two real `vllm serve` CPU servers, each with the kvdir connector and its own
`kvdir agent serve` over a 3-replica directory, behind `kvdir gateway` with
random routing (seeded, so the route sequence is fixed). A 5-turn chat with a
long system prompt: every turn that lands on the other server must load its
prefix from the pool (the connector's kvdir:loaded_blocks_total and vLLM's
external-hit counter grow there), and every answer must equal a single-engine
run of the same messages (greedy; a fresh cache_salt on one server matches
nothing, so that server recomputes the whole prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvdir.core.client import namespace
from kvdir.core.hashing import vllm_block_digests
from kvdir.local import (
    ClusterError,
    LocalAgent,
    LocalCluster,
    free_ports,
    wait_agent_sees,
    wait_for,
)
from kvdir.replay.vllm_serve import (
    BLOCK_TOKENS,
    CHAT_TEMPLATE,
    ChatModel,
    Gateway,
    Server,
    gateway_toml,
    prom_value,
    served_by,
    served_counts,
    start_all,
    words,
)
from tests.vllm.engines import LOOKUP_TIMEOUT_MS

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TURNS = 5
GATEWAY_SEED = 3
"""Random routing with this seed switches servers between turns (asserted below)."""
SYSTEM_WORDS = 300
USER_WORDS = 40
OUT_TOKENS = 16
REQUEST_TIMEOUT_S = 180.0
HELD_WAIT_S = 60.0
POOL_SLOTS = 512


@dataclass
class Stack:
    cluster: LocalCluster
    model: ChatModel
    model_dir: Path
    servers: dict[str, Server]
    gateway: Gateway


def _agent(cluster: LocalCluster, base: Path, name: str, model: ChatModel) -> LocalAgent:
    agent = LocalAgent(
        name,
        str(base),
        cluster.grpc_addresses,
        model.pool_spec(POOL_SLOTS),
        "tcp,shm",
        lease_ms=15_000,
    )
    try:
        agent.launch(timeout_s=60)
    except ClusterError:
        agent.stop()
        raise
    return agent


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("openai")
    model = ChatModel()
    model_dir = model.write(base / "model")
    agents: list[LocalAgent] = []
    servers: dict[str, Server] = {}
    gw: Gateway | None = None
    try:
        for name in ("a", "b"):
            agent = _agent(cluster, base, name, model)
            agents.append(agent)
            servers[name] = Server(
                name,
                model,
                model_dir,
                base,
                agent.engine_socket,
                connector_extra={"lookup_timeout_ms": LOOKUP_TIMEOUT_MS},
            )
        start_all(list(servers.values()))
        (port,) = free_ports(1)
        toml = gateway_toml(
            port,
            cluster.grpc_addresses,
            "random",
            model,
            model_dir,
            [(s, n) for n, s in servers.items()],
            GATEWAY_SEED,
        )
        gw = Gateway(base, toml, port)
        gw.start(len(servers))
        yield Stack(cluster, model, model_dir, servers, gw)
    finally:
        if gw is not None:
            gw.stop()
        for s in servers.values():
            s.stop()
        for a in agents:
            a.stop()


def _tokens(stack: Stack, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as the servers and the gateway tokenize it (the template is a plain join)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    assert "<|assistant|>" in CHAT_TEMPLATE
    text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return list(tok.encode(text + "<|assistant|>", add_special_tokens=False).ids)


def _wait_held(stack: Stack, tokens: list[int], node: str) -> None:
    ns = namespace(stack.model.name, BLOCK_TOKENS, "bf16", stack.model.layout, 0, 1)
    chain = vllm_block_digests(tokens, BLOCK_TOKENS, "sha256")

    def held() -> bool:
        with stack.cluster.client(timeout_s=5) as c:
            resp = c.lookup(ns, chain)
        return any(m.node_id == node and m.prefix_blocks >= len(chain) for m in resp.matches)

    wait_for(held, HELD_WAIT_S, f"{node} to hold the turn's {len(chain)} blocks", 0.1)
    for name, server in stack.servers.items():  # each agent reads its own mirror
        if name != node:
            wait_agent_sees(server.agent_socket, ns, chain, node, len(chain), HELD_WAIT_S)


def _ask(client: Any, model: str, messages: list[dict[str, str]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=OUT_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, **extra},
    )


def _loaded(stack: Stack) -> dict[str, float]:
    return {
        n: prom_value(s.metrics(), "kvdir:loaded_blocks_total") for n, s in stack.servers.items()
    }


def _lookup_counts(stack: Stack) -> dict[str, dict[str, float]]:
    """Why a server loaded nothing: its lookups, those past their deadline, agent outages."""
    names = ("lookups", "lookup_timeouts", "agent_unavailable", "validation_misses")
    out = {}
    for n, server in stack.servers.items():
        text = server.metrics()
        out[n] = {k: prom_value(text, f"kvdir:{k}_total") for k in names}
    return out


@pytest.mark.timeout(1800)
def test_five_turn_chat_through_the_gateway_loads_prefixes_and_matches(stack: Stack) -> None:
    client = openai.OpenAI(
        base_url=stack.gateway.url + "/v1",
        api_key="unused",
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    )
    messages = [{"role": "system", "content": words(7, SYSTEM_WORDS)}]
    history: list[tuple[list[dict[str, str]], str, str]] = []
    loaded_before: list[dict[str, float]] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": words(100 + turn, USER_WORDS)})
        loaded_before.append(_loaded(stack))
        counts = served_counts(stack.servers)
        resp = _ask(client, stack.model.name, messages)
        node = served_by(stack.servers, counts)
        tokens = _tokens(stack, messages)
        assert resp.usage.prompt_tokens == len(tokens)  # the test keys what the servers keyed
        answer = resp.choices[0].message.content
        history.append((list(messages), answer, node))
        _wait_held(stack, tokens, node)
        messages.append({"role": "assistant", "content": answer})
    routes = [node for _, _, node in history]
    switched = [i for i in range(1, TURNS) if routes[i] != routes[i - 1]]
    assert switched, f"routes {routes}: pick a GATEWAY_SEED that switches servers"
    after = _loaded(stack)
    for i in switched:  # the turn's own server loaded blocks during it
        node = routes[i]
        upto = loaded_before[i + 1][node] if i + 1 < TURNS else after[node]
        assert upto > loaded_before[i][node], (
            f"turn {i + 1} on {node} loaded nothing ({routes}); {_lookup_counts(stack)}"
        )
    hits = {
        n: prom_value(s.metrics(), "vllm:external_prefix_cache_hits_total")
        for n, s in stack.servers.items()
    }
    assert sum(hits.values()) > 0, hits
    ref = openai.OpenAI(
        base_url=stack.servers["a"].url + "/v1",
        api_key="unused",
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    )
    for i, (msgs, answer, _) in enumerate(history):
        got = _ask(ref, stack.model.name, msgs, cache_salt=f"ref-{i}")
        assert got.choices[0].message.content == answer, f"turn {i + 1} ({routes})"
