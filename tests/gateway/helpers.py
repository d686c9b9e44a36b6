"""Test helpers of the gateway tier: a tokenizer trained here, echo backends, HTTP calls."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvdir.gateway.echo_backend import EchoBackend
from kvdir.local import LOOPBACK

MODEL = "test-model"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7)))
        for _ in range(400)
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def train_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer trained on generated text (no downloads), saved as JSON."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [words(i, 200) for i in range(60)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL))
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


@dataclass
class Backends:
    """Echo backends on one background event loop, each on its own loopback port."""

    names: list[str]
    servers: dict[str, EchoBackend] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _runners: list[web.AppRunner] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def start(self) -> Backends:
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        for n in self.names:
            self.servers[n] = EchoBackend(n, MODEL)
            self.ports[n] = asyncio.run_coroutine_threadsafe(self._serve(n), self._loop).result(10)
        return self

    async def _serve(self, name: str) -> int:
        runner = web.AppRunner(self.servers[name].app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        self._runners.append(runner)
        port: int = runner.addresses[0][1]
        return port

    def url(self, name: str) -> str:
        return f"http://{LOOPBACK}:{self.ports[name]}"

    def stop(self) -> None:
        async def down() -> None:
            for r in self._runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop.close()


def backend_cfg(b: Backends, name: str, **kw: Any) -> dict[str, Any]:
    return {"url": b.url(name), "node_id": name, "host": f"10.0.0.{len(name)}", **kw}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    port: int,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    timeout_s: float = 20.0,
) -> Reply:
    """One HTTP/1.1 request to the gateway on loopback; the whole response."""
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection("localhost", port, timeout=timeout_s, context=tls)
    else:
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout_s)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def metric(port: int, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample's value from the gateway's /metrics (0 when absent)."""
    text = call(port, "GET", "/metrics").body.decode()
    want = labels or {}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, lab = head.partition("{")
        if sample != name:
            continue
        got = dict(
            (kv.split("=", 1)[0], kv.split("=", 1)[1].strip('"'))
            for kv in lab.rstrip("}").split(",")
            if "=" in kv
        )
        if all(got.get(k) == v for k, v in want.items()):
            total += float(value)
    return total
