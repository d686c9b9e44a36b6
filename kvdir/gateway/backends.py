"""The backends: health, load (in-flight counts, engine gauges) and concurrency limits.

A backend is a candidate when it is healthy, serves the request's model and
has fewer than `max_concurrency` requests in flight through this gateway.
Health comes from a periodic GET of `health_path` (200 = healthy) and from
the request path: a backend that fails before sending a byte is marked
unhealthy at once and comes back with its next good health check.

`acquire` picks and reserves in one step on the event loop (no await between
the choice and the increment), so the load the router saw is the load it set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvdir.gateway.config import BackendConfig
from kvdir.gateway.errors import RequestError
from kvdir.routing import Candidate, EngineLoad, backend_load

log = logging.getLogger("kvdir.gateway")


@dataclass(slots=True)
class Backend:
    cfg: BackendConfig
    healthy: bool = True
    inflight: int = 0
    last_error: str = ""
    engine: EngineLoad | None = None
    """The engine's own load gauges at the last poll (engine_load.py); None: none."""
    engine_lost: bool = False
    """The last poll failed (it was logged; the next success is logged too)."""
    candidate: Candidate = field(init=False)

    def __post_init__(self) -> None:
        self.candidate = Candidate(
            self.cfg.node_id, 0, self.cfg.host, frozenset(self.cfg.transports)
        )

    @property
    def node_id(self) -> str:
        return self.cfg.node_id

    def serves(self, model: str | None) -> bool:
        return model is None or not self.cfg.models or model in self.cfg.models

    @property
    def load(self) -> float:
        """What the router weighs: in-flight requests and the engine's own gauges."""
        return backend_load(self.inflight, self.engine)

    def as_candidate(self) -> Candidate:
        c = self.candidate
        return Candidate(c.node_id, self.load, c.host, c.transports)


class BackendPool:
    def __init__(
        self,
        cfgs: Sequence[BackendConfig],
        on_health: Callable[[Backend], None] = lambda b: None,
    ) -> None:
        self.backends = [Backend(c) for c in cfgs]
        self.by_id = {b.node_id: b for b in self.backends}
        self._freed = asyncio.Condition()
        self._on_health = on_health

    def candidates(self, model: str | None, exclude: set[str]) -> list[Backend]:
        return [
            b
            for b in self.backends
            if b.healthy
            and b.serves(model)
            and b.inflight < b.cfg.max_concurrency
            and b.node_id not in exclude
        ]

    async def wait_candidates(
        self, model: str | None, exclude: set[str], timeout_s: float
    ) -> list[Backend]:
        """Candidates now, or after a slot frees (bounded); RequestError 503 when none."""
        found = self.candidates(model, exclude)
        if found:
            return found
        usable = [
            b for b in self.backends if b.healthy and b.serves(model) and b.node_id not in exclude
        ]
        if not usable:
            raise RequestError(
                503, f"no healthy backend serves model {model!r}" if model else "no healthy backend"
            )
        deadline = time.monotonic() + timeout_s
        async with self._freed:
            while not found:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestError(
                        503, f"every backend is at max_concurrency for {timeout_s:g} s; retry later"
                    )
                try:
                    await asyncio.wait_for(self._freed.wait(), left)
                except TimeoutError:
                    continue
                found = self.candidates(model, exclude)
        return found

    def take(self, b: Backend) -> None:
        b.inflight += 1

    async def release(self, b: Backend) -> None:
        b.inflight -= 1
        async with self._freed:
            self._freed.notify()

    def mark(self, b: Backend, healthy: bool, why: str = "") -> None:
        if b.healthy != healthy:
            if healthy:
                log.info("backend %s (%s) healthy again", b.node_id, b.cfg.url)
            else:
                log.warning("backend %s (%s) unhealthy: %s", b.node_id, b.cfg.url, why)
        b.healthy = healthy
        b.last_error = why
        self._on_health(b)

    async def check(self, session: aiohttp.ClientSession, path: str, timeout_s: float) -> None:
        """One health round over every backend, concurrently."""

        async def one(b: Backend) -> None:
            try:
                async with session.get(
                    b.cfg.url.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as r:
                    await r.read()
                    ok = r.status == 200
                    why = "" if ok else f"{path} answered {r.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                ok, why = False, f"{path}: {type(e).__name__}: {e}"
            self.mark(b, ok, why)

        await asyncio.gather(*(one(b) for b in self.backends))
        async with self._freed:
            self._freed.notify_all()

    async def health_loop(
        self, session: aiohttp.ClientSession, path: str, interval_s: float, timeout_s: float
    ) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.check(session, path, timeout_s)
