"""The engines' own load signals: poll each backend's Prometheus `/metrics` (vLLM's names).

Every `engine_metrics_interval_s` the gateway GETs `<url><engine_metrics_path>`
from every backend at once, each within `engine_metrics_timeout_s`, and keeps
the reading on the backend (`Backend.engine`), where `kvdir.routing.backend_load`
turns it and the in-flight count into the router's load. A backend whose
metrics are absent (404, no such gauges: an echo server, an engine without
metrics), unreadable or late has no reading: it is routed on in-flight counts
alone. The gateway logs such a backend once when it loses its reading and once
when it has one again, not on every poll.

The gauges are vLLM's (vllm/v1/metrics/loggers.py): `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (a fraction, 1 = full),
one sample per engine (label `engine`) behind one API server; running and
waiting are summed over them, the KV usage is the highest.
"""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvdir.gateway.backends import Backend, BackendPool
from kvdir.routing.load import EngineLoad

log = logging.getLogger("kvdir.gateway")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
_NAMES = (RUNNING, WAITING, KV_USAGE)
METRICS_BODY_MAX_BYTES = 4 * 1024 * 1024
"""Largest /metrics page read (a vLLM server's is ~100-300 kB)."""


class MetricsError(ValueError):
    """A /metrics page without usable load gauges."""


def _samples(text: str) -> dict[str, list[float]]:
    """The three gauges' sample values; only their lines go through the parser."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    out: dict[str, list[float]] = {n: [] for n in _NAMES}
    try:
        for family in text_string_to_metric_families(wanted + "\n"):
            for s in family.samples:
                if s.name in out:
                    out[s.name].append(float(s.value))
    except ValueError as e:
        raise MetricsError(f"unparsable gauge line: {e}") from None
    return out


def parse_vllm(text: str, inflight_at_poll: int = 0) -> EngineLoad:
    """An `EngineLoad` from a vLLM-style /metrics page; MetricsError when it has none."""
    got = _samples(text)
    if not got[RUNNING] or not got[WAITING]:
        raise MetricsError(f"no {RUNNING} and {WAITING} gauges")
    values = [v for vs in got.values() for v in vs]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise MetricsError("a load gauge is negative or not finite")
    kv = max(got[KV_USAGE], default=0.0)
    if kv > 1:
        raise MetricsError(f"{KV_USAGE} {kv} is above 1 (a fraction is expected)")
    return EngineLoad(sum(got[RUNNING]), sum(got[WAITING]), kv, inflight_at_poll)


async def _read_capped(r: aiohttp.ClientResponse, cap_bytes: int) -> bytes:
    buf = bytearray()
    async for chunk in r.content.iter_chunked(64 * 1024):
        buf += chunk
        if len(buf) > cap_bytes:
            raise MetricsError(f"the page is over {cap_bytes} bytes")
    return bytes(buf)


class EngineLoadPoller:
    """Keeps `Backend.engine` fresh for every backend of `pool` (one task per gateway)."""

    def __init__(self, pool: BackendPool, path: str, interval_s: float, timeout_s: float) -> None:
        self.pool = pool
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.rounds = 0
        """Completed polling rounds (tests wait on it)."""

    async def loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.poll(session)
            await asyncio.sleep(self.interval_s)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._one(session, b) for b in self.pool.backends))
        self.rounds += 1

    async def _one(self, session: aiohttp.ClientSession, b: Backend) -> None:
        url = b.cfg.url.rstrip("/") + self.path
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    raise MetricsError(f"{self.path} answered {r.status}")
                body = await _read_capped(r, METRICS_BODY_MAX_BYTES)
            reading = parse_vllm(body.decode("utf-8", "replace"), b.inflight)
        except (MetricsError, aiohttp.ClientError, TimeoutError, OSError) as e:
            self._lost(b, f"{type(e).__name__}: {e}")
            return
        if b.engine is None and b.engine_lost:
            log.info("backend %s: engine load signals back from %s", b.node_id, url)
        b.engine, b.engine_lost = reading, False

    def _lost(self, b: Backend, why: str) -> None:
        if not b.engine_lost:
            log.warning(
                "backend %s: no engine load from %s (%s); routing it on in-flight counts only",
                b.node_id,
                b.cfg.url.rstrip("/") + self.path,
                why,
            )
        b.engine, b.engine_lost = None, True
