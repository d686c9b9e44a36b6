"""A small OpenAI-compatible server without a model, for tests and `kvdir bench gateway`.

It answers `/v1/completions` and `/v1/chat/completions` (JSON, or SSE when
`"stream": true`), `/v1/models` and `/health` the way vLLM's server shapes
them, with a text naming the backend, so a caller can tell who answered. It
records what it received (path, `X-Kvdir-*` headers, body digest) in a
bounded list served at `GET /_seen`, and `POST /_mode` makes it misbehave:

- `reset`: close every request's connection before answering (fails before a byte);
- `break`: send the response headers and one chunk, then cut the connection;
- `unhealthy`: `/health` answers 503 (requests are still served);
- `delay_s`: wait that long before answering (a slow prefill).

`GET /metrics` answers vLLM's load gauges (`vllm:num_requests_running`: the
requests being answered now; `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`: what `POST /_load` set), or, as `POST /_load`'s
`metrics` says, 404 (`absent`) or an unparsable page (`broken`).

    python -m kvdir.gateway.echo_backend --port 8001 --name b1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import time
from typing import Any

from aiohttp import web

SEEN_MAX = 4096
MODES = ("ok", "reset", "break", "unhealthy")
METRICS_MODES = ("ok", "absent", "broken")


class EchoBackend:
    def __init__(
        self, name: str, model: str = "test-model", stream_chunks: int = 4, fixed: bool = False
    ) -> None:
        self.name = name
        self.fixed = fixed
        """Answer one small JSON without reading the prompt (a benchmark's cheapest backend)."""
        self.model = model
        self.stream_chunks = stream_chunks
        self._fixed_body = json.dumps(
            {
                "id": f"cmpl-{name}",
                "object": "text_completion",
                "backend": name,
                "choices": [{"index": 0, "text": f"from {name}", "finish_reason": "length"}],
            }
        ).encode()
        self.mode = "ok"
        self.delay_s = 0.0
        self.active = 0
        self.max_active = 0
        self.seen: collections.deque[dict[str, Any]] = collections.deque(maxlen=SEEN_MAX)
        self.waiting = 0
        self.kv_usage = 0.0
        self.metrics_mode = "ok"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/_seen", self._seen)
        app.router.add_post("/_mode", self._set_mode)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/_load", self._set_load)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_mode == "absent":
            return web.Response(status=404)
        if self.metrics_mode == "broken":
            return web.Response(text='vllm:num_requests_running{engine="0" }} x\n')
        labels = f'engine="0",model_name="{self.model}"'
        lines = []
        for name, kind, value in (
            ("vllm:num_requests_running", "gauge", float(self.active)),
            ("vllm:num_requests_waiting", "gauge", float(self.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", self.kv_usage),
        ):
            lines += [f"# HELP {name} {name}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{{{labels}}} {value}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _set_load(self, request: web.Request) -> web.Response:
        req = await request.json()
        waiting, kv = req.get("waiting", 0), req.get("kv_usage", 0.0)
        mode = req.get("metrics", "ok")
        if (
            mode not in METRICS_MODES
            or not isinstance(waiting, int)
            or waiting < 0
            or not isinstance(kv, int | float)
            or not 0 <= kv <= 1
        ):
            return web.json_response(
                {"error": f"metrics must be one of {METRICS_MODES}, waiting >= 0, kv_usage 0..1"},
                status=400,
            )
        self.waiting, self.kv_usage, self.metrics_mode = waiting, float(kv), mode
        return web.json_response({"metrics": mode})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": self.name}],
            }
        )

    async def _seen(self, request: web.Request) -> web.Response:
        return web.json_response({"seen": list(self.seen), "max_active": self.max_active})

    async def _set_mode(self, request: web.Request) -> web.Response:
        req = await request.json()
        mode, delay = req.get("mode"), req.get("delay_s", 0.0)
        if mode not in MODES or not isinstance(delay, int | float) or not 0 <= delay <= 60:
            return web.json_response(
                {"error": f"mode must be one of {MODES}, delay_s in 0..60"}, status=400
            )
        self.mode, self.delay_s = mode, float(delay)
        return web.json_response({"mode": mode})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)  # a slow prefill
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.fixed:
            return web.Response(body=self._fixed_body, content_type="application/json")
        if self.mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        self.seen.append(
            {
                "path": request.path,
                "backend": self.name,
                "sha256": hashlib.sha256(body).hexdigest(),
                "content_type": request.headers.get("Content-Type", ""),
                "kvdir": {
                    k: v for k, v in request.headers.items() if k.lower().startswith("x-kvdir-")
                },
            }
        )
        try:
            req = json.loads(body)
        except ValueError:
            return web.json_response({"error": {"message": "bad JSON"}}, status=400)
        chat = request.path.endswith("chat/completions")
        text = f"from {self.name}"
        created = int(time.time())
        if not req.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return web.json_response(
                {
                    "id": f"cmpl-{self.name}",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": req.get("model", self.model),
                    "backend": self.name,
                    "choices": [choice],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.stream_chunks):
            piece = f"{text} {i}"
            delta: dict[str, Any] = {"index": 0}
            if chat:
                delta["delta"] = {"content": piece}
            else:
                delta["text"] = piece
            event = {"id": f"cmpl-{self.name}", "created": created, "choices": [delta]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.mode == "break":
                assert request.transport is not None
                request.transport.abort()
                return resp
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--model", default="test-model")
    p.add_argument("--fixed", action="store_true", help="answer without parsing the prompt")
    a = p.parse_args()
    backend = EchoBackend(a.name, a.model, fixed=a.fixed)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(backend.app(), host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
