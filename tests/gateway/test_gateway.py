"""The gateway end to end: echo backends over HTTP, a real directory replica, a tokenizer
trained here. Routing decisions are checked against what the directory holds, with the
keys computed by the agent's own event-hash code (what it would publish for vLLM)."""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvdir.agent.events.hashes import keys
from kvdir.agent.events.selfcheck import first_block_hashes
from kvdir.agent.pull_hint import parse
from kvdir.core.client import DirectoryClient
from kvdir.gateway.chain import model_namespace
from kvdir.gateway.config import from_dict
from kvdir.gateway.prompt import ModelPrompts
from kvdir.gateway.server import BackgroundGateway
from kvdir.local import free_ports, wait_for
from tests.gateway.helpers import MODEL, Backends, backend_cfg, call, metric, words
from tests.integration.helpers import LONG_LEASE_MS, publish

pytestmark = pytest.mark.integration


def _config(
    backends: Backends, tok: tuple[Path, Path], directory: list[str], **kw: Any
) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:0",
        "directory": directory,
        "health_interval_s": 0.2,
        "lookup_timeout_ms": 2000,
        "models": [
            {
                "name": MODEL,
                "tokenizer": str(tok[0]),
                "chat_template": str(tok[1]),
                "bos_token": "<s>",
                "block_tokens": 16,
                "hash": "vllm",
            }
        ],
        "backends": [backend_cfg(backends, n, transports=["rdma", "tcp"]) for n in backends.names],
        **kw,
    }


@contextmanager
def gateway(raw: dict[str, Any]) -> Iterator[BackgroundGateway]:
    gw = BackgroundGateway(from_dict(raw))
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()


def _vllm_keys(tokens: Sequence[int]) -> list[bytes]:
    """The keys the agent indexes for vLLM's BlockStored events of these tokens."""
    return keys(first_block_hashes(tokens, 16, "sha256", ""))


def _seen(backends: Backends, name: str) -> list[dict[str, Any]]:
    return list(backends.servers[name].seen)


def _register(directory: DirectoryClient, names: list[str], salt: str) -> dict[str, str]:
    ids = {n: f"{n}-{salt}" for n in names}
    for n, node in ids.items():
        directory.register_node(node, f"10.0.0.{len(n)}", 1, "", ["rdma", "tcp"], LONG_LEASE_MS)
    return ids


@pytest.mark.timeout(120)
def test_routes_to_the_directorys_holder_and_hints_the_pull(
    backends: Backends, tokenizer_files: tuple[Path, Path], directory: DirectoryClient
) -> None:
    ids = _register(directory, backends.names, "route")
    raw = _config(backends, tokenizer_files, directory.addresses, policy="affinity+pool")
    for b in raw["backends"]:
        b["node_id"] = ids[b["node_id"]]
    cfg = from_dict(raw)
    ns = model_namespace(cfg.models[0])
    tok = Tokenizer.from_file(str(tokenizer_files[0]))

    # 1. text prompt: b2 holds the whole chain, b3 half of it -> affinity picks b2.
    text = words(1, 2500)
    tokens = tok.encode(text, add_special_tokens=True).ids
    chain = _vllm_keys(tokens)
    assert len(chain) >= 100
    publish(directory, ids["b2"], 1, ns, chain)
    publish(directory, ids["b3"], 1, ns, chain[: len(chain) // 2])
    # 2. chat prompt: the gateway's template rendering; b3 holds its whole chain.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": words(2, 2000)}]}
    chat_tokens = ModelPrompts(cfg.models[0]).chat_tokens(chat)
    assert chat_tokens is not None
    publish(directory, ids["b3"], 1, ns, _vllm_keys(chat_tokens))
    # 3. a prompt only b1 holds, while b1 fails its health checks -> a pull hint.
    pull_text = words(3, 2500)
    pull_chain = _vllm_keys(tok.encode(pull_text, add_special_tokens=True).ids)
    publish(directory, ids["b1"], 1, ns, pull_chain)

    with gateway(raw) as gw:
        body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 4}).encode()
        r = call(gw.gateway.port, "POST", "/v1/completions", body)
        assert r.status == 200, r.body
        assert r.json()["backend"] == "b2"
        (seen,) = _seen(backends, "b2")
        assert seen["sha256"] == hashlib.sha256(body).hexdigest()  # the body is unchanged
        route = seen["kvdir"]["X-Kvdir-Route"]
        assert f"node={ids['b2']}" in route and "rule=affinity" in route
        assert f"local={len(chain)}" in route and "X-Kvdir-Pull" not in seen["kvdir"]

        # token-id prompts are used as they are: the same chain, the same holder
        r = call(gw.gateway.port, "POST", "/v1/completions", {"model": MODEL, "prompt": tokens})
        assert r.json()["backend"] == "b2"

        r = call(gw.gateway.port, "POST", "/v1/chat/completions", chat)
        assert r.status == 200 and r.json()["backend"] == "b3"

        backends.servers["b1"].mode = "unhealthy"
        wait_for(
            lambda: (
                metric(gw.gateway.port, "kvdir_gateway_backend_healthy", {"backend": ids["b1"]})
                == 0
            ),
            10,
            "b1 marked unhealthy",
        )
        r = call(gw.gateway.port, "POST", "/v1/completions", {"model": MODEL, "prompt": pull_text})
        assert r.status == 200
        answered = r.json()["backend"]
        assert answered in ("b2", "b3")
        hint = parse(_seen(backends, answered)[-1]["kvdir"]["X-Kvdir-Pull"])
        assert (hint.peer, hint.local_blocks, hint.blocks, hint.transport) == (
            ids["b1"],
            0,
            len(pull_chain),
            "rdma",
        )
        port = gw.gateway.port
        assert metric(port, "kvdir_gateway_decisions_total", {"rule": "affinity"}) == 3
        assert metric(port, "kvdir_gateway_decisions_total", {"rule": "pool"}) == 1
        hit = metric(port, "kvdir_gateway_predicted_hit_tokens_total", {"source": "local"})
        assert hit == 16 * (2 * len(chain) + len(_vllm_keys(chat_tokens)))
        pulled = metric(port, "kvdir_gateway_predicted_hit_tokens_total", {"source": "pulled"})
        assert pulled == 16 * len(pull_chain)
        assert metric(port, "kvdir_gateway_added_seconds_count") == 4


def _events(body: bytes) -> list[str]:
    lines = [x for x in body.decode().split("\n\n") if x]
    assert all(x.startswith("data: ") for x in lines), lines
    return [x[len("data: ") :] for x in lines]


@pytest.mark.timeout(60)
def test_streams_sse_through_untouched(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    with gateway(_config(backends, tokenizer_files, [], policy="round-robin")) as gw:
        for path, req in (
            ("/v1/completions", {"model": MODEL, "prompt": "ab cd", "stream": True}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
        ):
            r = call(gw.gateway.port, "POST", path, req)
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r.body)
            assert events[-1] == "[DONE]" and len(events) == 5
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            key = "delta" if "chat" in path else "text"
            assert all(key in c for c in chunks)
        r = call(gw.gateway.port, "GET", "/v1/models")
        assert r.status == 200 and r.json()["data"][0]["id"] == MODEL


@pytest.mark.timeout(90)
def test_failing_backend_is_retried_elsewhere_and_readmitted(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    raw = _config(backends, tokenizer_files, [], policy="round-robin", retries=2)
    with gateway(raw) as gw:
        port = gw.gateway.port
        backends.servers["b1"].mode = "reset"  # drops every connection before a byte
        for _ in range(6):
            r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
            assert r.status == 200 and r.json()["backend"] in ("b2", "b3")
        assert metric(port, "kvdir_gateway_retries_total") >= 1
        assert metric(port, "kvdir_gateway_backend_errors_total", {"stage": "connect"}) >= 1
        assert metric(port, "kvdir_gateway_backend_healthy", {"backend": "b1"}) == 0
        backends.servers["b1"].mode = "ok"
        wait_for(
            lambda: metric(port, "kvdir_gateway_backend_healthy", {"backend": "b1"}) == 1,
            10,
            "b1 readmitted by its health check",
        )
        answered = {
            call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1]}).json()["backend"]
            for _ in range(3)
        }
        assert answered == {"b1", "b2", "b3"}

        for s in backends.servers.values():
            s.mode = "reset"
        r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1]})
        assert r.status in (502, 503)
        assert r.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_backend_breaking_mid_stream_cuts_the_client(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    for n in ("b1", "b3"):
        backends.servers[n].mode = "unhealthy"
    backends.servers["b2"].mode = "break"
    raw = _config(backends, tokenizer_files, [], policy="least-loaded")
    with gateway(raw) as gw:
        port = gw.gateway.port
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        req = json.dumps({"model": MODEL, "prompt": [5, 6], "stream": True})
        conn.request("POST", "/v1/completions", body=req)
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead):
            resp.read()
        conn.close()
        assert metric(port, "kvdir_gateway_backend_errors_total", {"stage": "stream"}) == 1


@pytest.mark.timeout(60)
def test_concurrency_limit_per_backend(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    import threading

    for n in ("b1", "b3"):
        backends.servers[n].mode = "unhealthy"
    backends.servers["b2"].delay_s = 0.2
    raw = _config(backends, tokenizer_files, [], policy="least-loaded")
    for b in raw["backends"]:
        b["max_concurrency"] = 2
    with gateway(raw) as gw:
        results: list[int] = []

        def one() -> None:
            r = call(gw.gateway.port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1]})
            results.append(r.status)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [200] * 6
        assert backends.servers["b2"].max_active == 2  # queued at the gateway, never 3


@pytest.mark.timeout(60)
def test_bad_requests_get_a_clear_4xx(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    raw = _config(backends, tokenizer_files, [], body_max_bytes=4096)
    raw["models"].append({"name": "ids-only", "hash": "kvdir"})
    with gateway(raw) as gw:
        port = gw.gateway.port
        cases: list[tuple[str, bytes | dict[str, Any], int, str]] = [
            ("/v1/completions", b"{not json", 400, "not valid JSON"),
            ("/v1/completions", b"[1, 2]", 400, "JSON object"),
            ("/v1/completions", {"prompt": "x"}, 400, "'model' is required"),
            ("/v1/completions", {"model": MODEL}, 400, "'prompt' is required"),
            ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "'prompt' must be"),
            ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "token ids"),
            ("/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}, 400, "token ids"),
            ("/v1/completions", {"model": "ids-only", "prompt": "text"}, 400, "no tokenizer"),
            ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "'messages'"),
            ("/v1/chat/completions", {"model": MODEL, "messages": ["x"]}, 400, "messages[0]"),
            ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 413, "over 4096 bytes"),
            ("/v1/embeddings", {"model": MODEL}, 404, "not served here"),
        ]
        for path, body, status, text in cases:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = call(port, "POST", path, data)
            assert r.status == status, (path, body, r.body)
            assert text in r.json()["error"]["message"], r.body
        assert all(not _seen(backends, n) for n in backends.names)  # none was forwarded
        # the gateway keeps serving
        r = call(port, "POST", "/v1/completions", {"model": "ids-only", "prompt": [1, 2]})
        assert r.status == 200


@pytest.mark.timeout(60)
def test_directory_outage_degrades_to_least_loaded(
    backends: Backends, tokenizer_files: tuple[Path, Path]
) -> None:
    (dead,) = free_ports(1)  # no replica listens there: the whole directory is down
    raw = _config(
        backends, tokenizer_files, [f"127.0.0.1:{dead}"], policy="affinity", lookup_timeout_ms=200
    )
    with gateway(raw) as gw:
        port = gw.gateway.port
        for i in range(4):
            r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": words(i, 100)})
            assert r.status == 200
        assert metric(port, "kvdir_gateway_directory_up") == 0
        assert metric(port, "kvdir_gateway_degraded_decisions_total") == 4
        assert metric(port, "kvdir_gateway_decisions_total", {"policy": "least-loaded"}) == 4
        assert metric(port, "kvdir_gateway_decisions_total", {"policy": "affinity"}) == 0
        health = call(port, "GET", "/health").json()
        assert health["directory_up"] is False and health["directory_reason"]
