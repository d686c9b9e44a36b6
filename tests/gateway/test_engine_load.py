"""Routing on the engines' own load gauges: echo backends serve vLLM-style /metrics."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from kvdir.gateway.config import from_dict
from kvdir.gateway.server import BackgroundGateway
from kvdir.local import wait_for
from kvdir.routing import DEFAULT_WEIGHTS
from tests.gateway.helpers import MODEL, Backends, backend_cfg, call, metric

pytestmark = pytest.mark.integration

POLL_S = 0.05


def _rounds(gw: BackgroundGateway) -> int:
    n: int = gw.call(lambda: gw.gateway.engine_load.rounds)
    return n


@pytest.mark.timeout(60)
def test_waiting_requests_on_an_engine_steer_traffic_away(
    backends: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    backends.servers["b1"].waiting = 40  # a queue the gateway did not send
    backends.servers["b2"].metrics_mode = "broken"
    backends.servers["b3"].metrics_mode = "absent"
    raw = {
        "listen": "127.0.0.1:0",
        "policy": "least-loaded",
        "engine_metrics_interval_s": POLL_S,
        "backends": [backend_cfg(backends, n) for n in backends.names],
    }
    caplog.set_level(logging.INFO, "kvdir.gateway")
    gw = BackgroundGateway(from_dict(raw))
    port = gw.start()
    try:
        wait_for(lambda: _rounds(gw) >= 3, 20, "three engine-load polls")
        # 40 waiting, counted once as queued and once more as waiting
        assert metric(port, "kvdir_gateway_backend_load", {"backend": "b1"}) == 40 * (
            1 + DEFAULT_WEIGHTS.waiting
        )
        for n in ("b2", "b3"):  # no usable gauges: in-flight only (none now)
            assert metric(port, "kvdir_gateway_backend_load", {"backend": n}) == 0
        got = Counter(
            call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [i]}).json()["backend"]
            for i in range(30)
        )
        assert got["b1"] == 0 and got["b2"] + got["b3"] == 30, got
        lost = [r.getMessage() for r in caplog.records if "no engine load" in r.getMessage()]
        assert sorted(m.split(":")[0] for m in lost) == ["backend b2", "backend b3"], lost

        backends.servers["b1"].waiting = 0  # the queue drains: b1 takes its share again
        backends.servers["b2"].metrics_mode = "ok"
        seen = _rounds(gw)
        wait_for(lambda: _rounds(gw) >= seen + 2, 20, "two more polls")
        assert metric(port, "kvdir_gateway_backend_load", {"backend": "b1"}) == 0
        back = [r.getMessage() for r in caplog.records if "signals back" in r.getMessage()]
        assert len(back) == 1 and back[0].startswith("backend b2"), back
        got = Counter(
            call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [i]}).json()["backend"]
            for i in range(30)
        )
        assert got["b1"] > 0, got
    finally:
        gw.stop()


@pytest.mark.timeout(60)
def test_a_full_kv_cache_counts_as_load(backends: Backends) -> None:
    backends.servers["b2"].kv_usage = 1.0
    raw = {
        "listen": "127.0.0.1:0",
        "policy": "least-loaded",
        "engine_metrics_interval_s": POLL_S,
        "backends": [backend_cfg(backends, n) for n in backends.names],
    }
    gw = BackgroundGateway(from_dict(raw))
    port = gw.start()
    try:
        wait_for(lambda: _rounds(gw) >= 2, 20, "two engine-load polls")
        assert metric(port, "kvdir_gateway_backend_load", {"backend": "b2"}) == DEFAULT_WEIGHTS.kv
        got = Counter(
            call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [i]}).json()["backend"]
            for i in range(20)
        )
        assert got["b2"] == 0, got
    finally:
        gw.stop()
