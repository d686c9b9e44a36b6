"""The gateway's HTTP server: parse, key, look up, route, forward (docs/gateway.md).

One asyncio event loop (uvloop when installed) runs an aiohttp server and
one aiohttp client session to the backends. Per request:

1. read the body (bounded by `body_max_bytes`) and parse what routing needs:
   the model, and the prompt's token ids (`prompt.py`);
2. the prompt's block keys (`chain.py`), the same the backends' agents publish;
3. who holds its prefix: a batched directory lookup (`lookup.py`), degrading
   to least-loaded when the directory cannot answer in time;
4. a `kvdir.routing.Router` decision over the healthy backends with a free
   slot, their in-flight counts as load;
5. forward the body unchanged, with `X-Kvdir-Route` and, when the decision
   pulls, `X-Kvdir-Pull` (agent/pull_hint.py); stream the response back as it
   comes (SSE untouched). A backend that fails before sending a byte is
   marked unhealthy and the request goes to another one (`retries`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvdir.agent.pull_hint import HEADER as PULL_HEADER
from kvdir.agent.pull_hint import ROUTE_HEADER, PullHint
from kvdir.core.client import DirectoryError
from kvdir.core.gc_freeze import freeze_startup
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.security import ClientSecurity
from kvdir.core.sharded_client import ShardedDirectoryClient
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.gateway.backends import Backend, BackendPool
from kvdir.gateway.chain import chain_fn, model_namespace
from kvdir.gateway.config import GatewayConfig, ModelConfig, directory_security, host_port
from kvdir.gateway.engine_load import EngineLoadPoller
from kvdir.gateway.errors import RequestError, bad_request
from kvdir.gateway.lookup import DirectoryLookups
from kvdir.gateway.metrics import GatewayMetrics
from kvdir.gateway.mirror_source import MirroredLookups
from kvdir.gateway.prompt import ModelPrompts
from kvdir.routing import SHAPES, Balance, CostModel, Decision, Policy, Prompt, Router

log = logging.getLogger("kvdir.gateway")

# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp recomputes are not forwarded;
# X-Kvdir-* from a client are dropped so nobody can forge a pull hint.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
_RESPONSE_DROP = frozenset(h for h in _HOP if h != "content-length")
_ROUTED = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_RETRYABLE = (aiohttp.ClientConnectionError, TimeoutError, OSError)
Lookups = DirectoryLookups | MirroredLookups


class _Model:
    """A configured model, ready: prompts, chain function, namespace and cost model."""

    def __init__(self, cfg: ModelConfig, gw: GatewayConfig) -> None:
        self.cfg = cfg
        self.prompts = ModelPrompts(cfg)
        self.chain = chain_fn(cfg)
        self.ns = model_namespace(cfg)
        self.cost = CostModel(block_tokens=cfg.block_tokens, shape=SHAPES[cfg.shape])


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
        worker: int = 0,
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        """This process's index among `cfg.workers` (kvdir/gateway/workers.py)."""
        self.metrics = metrics or GatewayMetrics()
        self.policy = Policy(cfg.policy)
        self._rng = rng or random.Random(cfg.seed)
        self._clock = clock
        self.models = {m.name: _Model(m, cfg) for m in cfg.models}
        self._balance = Balance(cfg.balance_abs, cfg.balance_rel)
        self._routers: dict[tuple[str, Policy], Router] = {}
        self._default_cost = CostModel(block_tokens=16)
        self.pool = BackendPool(cfg.backends, self._health_changed)
        self.engine_load = EngineLoadPoller(
            self.pool,
            cfg.engine_metrics_path,
            cfg.engine_metrics_interval_s,
            cfg.engine_metrics_timeout_s,
        )
        self.lookups = _lookups(cfg, lambda up: self.metrics.directory_up.set(1 if up else 0))
        self._rr = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0
        for b in self.pool.backends:
            self.metrics.child("backend_healthy", b.node_id).set(1)
            self.metrics.child("backend_inflight", b.node_id).set_function(
                lambda b=b: float(b.inflight)
            )
            self.metrics.child("backend_load", b.node_id).set_function(lambda b=b: b.load)
        self.metrics.child("worker", str(worker)).set(1)
        if isinstance(self.lookups, MirroredLookups):
            lk = self.lookups
            self.metrics.child("lookups", "mirror").set_function(lambda: float(lk.served))
            self.metrics.child("lookups", "rpc").set_function(lambda: float(lk.fallbacks))

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.body_max_bytes)
        app.router.add_post("/v1/completions", self._routed)
        app.router.add_post("/v1/chat/completions", self._routed)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    def _ssl_server(self) -> ssl.SSLContext | None:
        if not self.cfg.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        return ctx

    async def start(self) -> None:
        client_ssl: ssl.SSLContext | bool = True
        if self.cfg.backend_ca_file:
            client_ssl = ssl.create_default_context(cafile=self.cfg.backend_ca_file)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=client_ssl, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        await self.pool.check(self._session, self.cfg.health_path, self.cfg.health_timeout_s)
        loop = asyncio.get_running_loop()
        self._tasks.append(
            loop.create_task(
                self.pool.health_loop(
                    self._session,
                    self.cfg.health_path,
                    self.cfg.health_interval_s,
                    self.cfg.health_timeout_s,
                )
            )
        )
        if self.cfg.engine_metrics and not self.cfg.passthrough:
            self._tasks.append(loop.create_task(self.engine_load.loop(self._session)))
        if not self.cfg.passthrough:
            self.lookups.start()
        await self._listen()

    async def _listen(self) -> None:
        """The shared `listen` port (SO_REUSEPORT with several workers), and this worker's own."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        host, port = host_port(self.cfg.listen, "listen")
        tls = self._ssl_server()
        shared = self.cfg.workers > 1
        site = web.TCPSite(
            self._runner, host, port, ssl_context=tls, backlog=1024, reuse_port=shared
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self.cfg.worker_port_base:
            own = self.cfg.worker_port_base + self.worker
            await web.TCPSite(self._runner, host, own, ssl_context=tls).start()
        log.info(
            "gateway worker %d listening on %s:%d (%s, policy %s, %d backends)",
            self.worker,
            host,
            self.port,
            "https" if self.cfg.tls_cert else "http",
            "passthrough" if self.cfg.passthrough else self.policy.value,
            len(self.pool.backends),
        )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._runner is not None:
            await self._runner.cleanup()
        await self.lookups.stop()
        if self._session is not None:
            await self._session.close()

    def _health_changed(self, b: Backend) -> None:
        self.metrics.child("backend_healthy", b.node_id).set(1 if b.healthy else 0)

    # -------------------------------------------------------------- handlers

    async def _not_found(self, request: web.Request) -> web.Response:
        return _error(
            RequestError(
                404,
                f"{request.method} {request.path} is not served here (POST /v1/completions, "
                "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics)",
                code="not_found",
            )
        )

    async def _health(self, request: web.Request) -> web.Response:
        up = [b.node_id for b in self.pool.backends if b.healthy]
        state = {
            "healthy_backends": up,
            "directory_up": self.lookups.up,
            "directory_reason": self.lookups.reason,
        }
        return web.json_response(state, status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """Answered by one healthy backend (they serve the same models, or a subset)."""
        try:
            return await self._forward(request, b"", None, None, set(), "models", 0.0)
        except RequestError as e:
            self.metrics.child("requests", "models", str(e.status)).inc()
            return _error(e)

    async def _routed(self, request: web.Request) -> web.StreamResponse:
        t0 = self._clock()
        endpoint = _ROUTED[request.path]
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    413, f"the request body is over {self.cfg.body_max_bytes} bytes"
                ) from None
            if self.cfg.passthrough:
                return await self._forward(request, body, None, None, set(), endpoint, t0)
            model, prompt, tokens = await self._prompt(body, endpoint)
            return await self._forward(request, body, model, (prompt, tokens), set(), endpoint, t0)
        except RequestError as e:
            self.metrics.child("requests", endpoint, str(e.status)).inc()
            return _error(e)

    # ------------------------------------------------------------- routing

    async def _prompt(self, body: bytes, endpoint: str) -> tuple[str, Prompt | None, int]:
        """The request's model, its prefix holders (None: route unkeyed), and token count."""
        t = self._clock()
        try:
            obj = orjson.loads(body)  # ~4x json's speed on long token-id lists
        except orjson.JSONDecodeError:
            try:  # what orjson refuses but JSON allows (integers past 64 bits)
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise bad_request(f"the body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise bad_request("the body must be a JSON object")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required (a string)", "model")
        m = self.models.get(model)
        if m is None:
            self.metrics.child("unrouted", "model-not-configured").inc()
            return model, None, 0
        if endpoint == "chat":
            tokens = m.prompts.chat_tokens(obj)
        else:
            tokens = m.prompts.completion_tokens(obj)
        t1 = self._clock()
        self.metrics.child("stage", "tokenize").observe(t1 - t)
        if tokens is None:
            self.metrics.child("unrouted", "no-chat-template").inc()
            return model, None, 0
        chain = m.chain(tokens)
        t2 = self._clock()
        self.metrics.child("stage", "hash").observe(t2 - t1)
        if not chain:
            return model, Prompt(0), len(tokens)
        found = await self.lookups.prompt(m.ns, chain)
        self.metrics.child("stage", "lookup").observe(self._clock() - t2)
        if found is None:
            return model, None, len(tokens)
        return model, found, len(tokens)

    def _router(self, model: str | None, policy: Policy) -> Router:
        key = (model or "", policy)
        r = self._routers.get(key)
        if r is None:
            m = self.models.get(model or "")
            cost = m.cost if m is not None else self._default_cost
            r = Router(policy, cost, self._rng, self._balance, clock=self._clock)
            self._routers[key] = r
        return r

    def _decide(
        self, model: str | None, routed: tuple[Prompt | None, int] | None, cands: list[Backend]
    ) -> tuple[Backend, Decision | None]:
        if routed is None:  # passthrough and /v1/models: round-robin, no decision
            self._rr += 1
            return cands[(self._rr - 1) % len(cands)], None
        prompt, ntokens = routed
        policy = self.policy
        if prompt is None:
            if model in self.models and ntokens:
                self.metrics.degraded.inc()
            policy = Policy.LEAST_LOADED
            prompt = Prompt(0)
        d = self._router(model, policy).decide([b.as_candidate() for b in cands], prompt)
        self.metrics.child("decisions", policy.value, d.rule.value).inc()
        self.metrics.child("stage", "decide").observe(d.decide_s)
        if ntokens:
            m = self.models.get(model or "")
            bt = m.cfg.block_tokens if m is not None else 0
            self.metrics.child("prompt_tokens", policy.value).inc(ntokens)
            self.metrics.child("hit_tokens", policy.value, "local").inc(d.local_blocks * bt)
            self.metrics.child("hit_tokens", policy.value, "pulled").inc(d.pulled_blocks * bt)
        return self.pool.by_id[d.node_id], d

    # ------------------------------------------------------------ forwarding

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        model: str | None,
        routed: tuple[Prompt | None, int] | None,
        tried: set[str],
        endpoint: str,
        t0: float,
    ) -> web.StreamResponse:
        assert self._session is not None
        last = ""
        for attempt in range(self.cfg.retries + 1):
            cands = await self.pool.wait_candidates(model, tried, self.cfg.queue_timeout_s)
            backend, decision = self._decide(model, routed, cands)
            headers = _forward_headers(request, decision)
            self.pool.take(backend)
            try:
                if attempt == 0 and t0:
                    self.metrics.added.observe(self._clock() - t0)
                try:
                    upstream = await self._session.request(
                        request.method,
                        backend.cfg.url.rstrip("/") + request.rel_url.path_qs,
                        data=body if request.method == "POST" else None,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(
                            sock_connect=self.cfg.connect_timeout_s,
                            sock_read=self.cfg.first_byte_timeout_s,
                        ),
                        allow_redirects=False,
                    )
                except _RETRYABLE as e:
                    last = f"{backend.node_id}: {type(e).__name__}: {e}"
                    self.metrics.child("backend_errors", backend.node_id, "connect").inc()
                    self.pool.mark(backend, False, last)
                    tried.add(backend.node_id)
                    if attempt < self.cfg.retries:
                        self.metrics.retries.inc()
                    continue
                async with upstream:
                    return await self._relay(request, upstream, backend, endpoint)
            finally:
                await self.pool.release(backend)
        raise RequestError(502, f"no backend answered after {len(tried)} attempts; last: {last}")

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        backend: Backend,
        endpoint: str,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _RESPONSE_DROP:
                resp.headers.add(k, v)
        await resp.prepare(request)
        chunks = upstream.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                # The backend broke mid-response: cut the client's connection so the
                # truncation shows (a clean end would pass a partial answer as whole).
                self.metrics.child("backend_errors", backend.node_id, "stream").inc()
                self.metrics.child("requests", endpoint, "0").inc()
                log.warning("backend %s broke mid-response: %s", backend.node_id, e)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            try:
                await resp.write(chunk)
            except (ConnectionError, aiohttp.ClientConnectionError):
                # the client went away; the upstream response closes with us
                self.metrics.child("requests", endpoint, "0").inc()
                return resp
        await resp.write_eof()
        self.metrics.child("requests", endpoint, str(upstream.status)).inc()
        return resp


def _lookups(cfg: GatewayConfig, on_state: Callable[[bool], None]) -> Lookups:
    """The directory source: a mirror in front of the batched RPC path, or the RPC alone."""
    security = directory_security(cfg)
    if cfg.shard_home:
        return _sharded_lookups(cfg, on_state, security)
    rpc = DirectoryLookups(
        cfg.directory,
        cfg.lookup_timeout_ms / 1000,
        cfg.directory_retry_s,
        cfg.lookup_batch_max,
        on_state=on_state,
        security=security,
    )
    if not (cfg.directory_mirror and cfg.directory):
        return rpc
    mirror = Mirror(max_staleness_s=cfg.directory_mirror_staleness_ms / 1000)
    return MirroredLookups(rpc, mirror, MirrorSync(mirror, cfg.directory, security))


def _sharded_lookups(
    cfg: GatewayConfig, on_state: Callable[[bool], None], security: ClientSecurity
) -> Lookups:
    """A sharded directory: the sharded client's merged lookups, behind a mirror of
    every group when the home's map is known at start (else the RPC path alone)."""
    client = ShardedDirectoryClient(
        cfg.shard_home, timeout_s=cfg.lookup_timeout_ms / 1000, security=security
    )
    rpc = DirectoryLookups(
        cfg.shard_home,
        cfg.lookup_timeout_ms / 1000,
        cfg.directory_retry_s,
        cfg.lookup_batch_max,
        on_state=on_state,
        security=security,
        sharded=client,
    )
    if not cfg.directory_mirror:
        return rpc
    try:
        shard_map = client.shard_map
    except DirectoryError as e:
        log.warning("no shard map at start (%s): lookups over gRPC only", e)
        return rpc
    mirror = ShardedMirror(shard_map, max_staleness_s=cfg.directory_mirror_staleness_ms / 1000)
    sync = ShardedMirrorSync(mirror, security, follow=client.refresh_map)
    return MirroredLookups(rpc, mirror, sync)


def _forward_headers(request: web.Request, d: Decision | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in _HOP or lk.startswith("x-kvdir-"):
            continue
        out[k] = v if k not in out else out[k] + ", " + v
    if d is not None:
        out[ROUTE_HEADER] = (
            f"node={d.node_id}; policy={d.policy.value}; rule={d.rule.value}; "
            f"local={d.local_blocks}"
        )
        if d.pull_from is not None and d.transport is not None and d.pulled_blocks > 0:
            hint = PullHint(d.pull_from, d.local_blocks, d.pulled_blocks, d.transport)
            out[PULL_HEADER] = hint.encode()
    return out


def _error(e: RequestError) -> web.Response:
    return web.Response(status=e.status, body=e.body(), content_type="application/json")


# -------------------------------------------------------------- hosting


class BackgroundGateway:
    """A gateway on its own event loop thread (tests, benchmarks, embedding)."""

    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.gateway = Gateway(cfg, metrics)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="gateway")

    def start(self, timeout_s: float = 30.0) -> int:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.gateway.start(), self._loop).result(timeout_s)
        return self.gateway.port

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run `fn` on the gateway's loop (its state is not thread-safe)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.gateway.stop(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self._loop.close()


def run_loop(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `main()` on uvloop (asyncio's own loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; an odd platform without it still runs
        asyncio.run(main())
        return
    uvloop.run(main())


def serve(cfg: GatewayConfig) -> None:
    """Run one gateway process until SIGTERM or SIGINT (the `kvdir gateway` daemon)."""
    import signal

    async def main() -> None:
        gw = Gateway(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await gw.start()
        freeze_startup("gateway")
        try:
            await stop.wait()
        finally:
            await gw.stop()

    run_loop(main)
