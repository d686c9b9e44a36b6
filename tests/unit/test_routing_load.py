"""A backend's load from in-flight counts and engine gauges (pure), and vLLM's /metrics."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdir.gateway.engine_load import KV_USAGE, RUNNING, WAITING, MetricsError, parse_vllm
from kvdir.routing import DEFAULT_WEIGHTS, EngineLoad, LoadWeights, backend_load
from kvdir.routing.load import kv_pressure

W = LoadWeights(waiting=1.0, kv=8.0, kv_knee=0.8)


def test_without_engine_gauges_the_load_is_the_inflight_count() -> None:
    assert backend_load(0, None) == 0
    assert backend_load(7, None) == 7


def test_engine_queue_counts_what_other_clients_sent() -> None:
    # this process has 2 in flight, the engine runs 10 and queues 4 (other gateways')
    e = EngineLoad(running=10, waiting=4, kv_usage=0.1, inflight_at_poll=2)
    assert backend_load(2, e, W) == 10 + 4 + 4 * W.waiting


def test_requests_sent_or_finished_since_the_poll_move_the_estimate() -> None:
    e = EngineLoad(running=5, waiting=0, kv_usage=0.0, inflight_at_poll=5)
    assert backend_load(8, e, W) == 8  # 3 more sent since the reading
    assert backend_load(1, e, W) == 1  # 4 of ours finished since
    stale = EngineLoad(running=0, waiting=0, kv_usage=0.0, inflight_at_poll=0)
    assert backend_load(6, stale, W) == 6  # never below our own in-flight


def test_kv_pressure_starts_at_the_knee() -> None:
    assert kv_pressure(0.5, 0.8) == 0
    assert kv_pressure(0.8, 0.8) == 0
    assert kv_pressure(0.9, 0.8) == pytest.approx(0.5)
    assert kv_pressure(1.0, 0.8) == 1
    full = EngineLoad(running=0, waiting=0, kv_usage=1.0)
    assert backend_load(0, full, W) == W.kv


@given(
    inflight=st.integers(0, 500),
    at_poll=st.integers(0, 500),
    running=st.integers(0, 500),
    waiting=st.integers(0, 500),
    kv=st.floats(0, 1),
    more=st.integers(1, 50),
)
def test_load_is_monotone_and_never_below_inflight(
    inflight: int, at_poll: int, running: int, waiting: int, kv: float, more: int
) -> None:
    e = EngineLoad(running, waiting, kv, at_poll)
    load = backend_load(inflight, e, DEFAULT_WEIGHTS)
    assert load >= inflight
    assert backend_load(inflight + more, e, DEFAULT_WEIGHTS) > load
    more_waiting = EngineLoad(running, waiting + more, kv, at_poll)
    assert backend_load(inflight, more_waiting, DEFAULT_WEIGHTS) > load


def _page(lines: list[str]) -> str:
    return "\n".join(["# HELP x y", "# TYPE x gauge", *lines]) + "\n"


def test_parses_vllm_gauges_summed_over_engines() -> None:
    page = _page(
        [
            f'{RUNNING}{{engine="0",model_name="m"}} 3.0',
            f'{RUNNING}{{engine="1",model_name="m"}} 2.0',
            f'{WAITING}{{engine="0",model_name="m"}} 4.0',
            f'{WAITING}{{engine="1",model_name="m"}} 1.0',
            f'{WAITING}_by_reason{{engine="0",model_name="m",reason="capacity"}} 99.0',
            f'{KV_USAGE}{{engine="0",model_name="m"}} 0.25',
            f'{KV_USAGE}{{engine="1",model_name="m"}} 0.5',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0',
        ]
    )
    assert parse_vllm(page, 3) == EngineLoad(5.0, 5.0, 0.5, 3)


def test_kv_usage_is_optional() -> None:
    page = _page([f'{RUNNING}{{engine="0"}} 1', f'{WAITING}{{engine="0"}} 0'])
    assert parse_vllm(page) == EngineLoad(1.0, 0.0, 0.0, 0)


@pytest.mark.parametrize(
    ("page", "why"),
    [
        ("", "no vllm:num_requests_running"),
        ("sglang:num_running_reqs 3\n", "no vllm:num_requests_running"),
        (f"{RUNNING} 1\n", "no vllm:num_requests_running"),
        (f'{RUNNING}{{engine="0" }} x\n{WAITING} 0\n', "unparsable"),
        (f"{RUNNING} -1\n{WAITING} 0\n", "negative or not finite"),
        (f"{RUNNING} NaN\n{WAITING} 0\n", "negative or not finite"),
        (f"{RUNNING} 1\n{WAITING} 0\n{KV_USAGE} 75\n", "above 1"),
    ],
)
def test_unusable_pages_are_refused_with_a_reason(page: str, why: str) -> None:
    with pytest.raises(MetricsError, match=why):
        parse_vllm(page)
