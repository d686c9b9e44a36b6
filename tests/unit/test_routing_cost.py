"""The routing cost model: prefill fits from MISSION.md's figures, pull versus recompute."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdir.routing.cost import (
    DEFAULT_LINKS,
    KIB,
    LLAMA3_8B,
    LLAMA_70B,
    MIB,
    CostModel,
    Link,
    ModelShape,
    fit_prefill,
)


def test_fits_reproduce_the_measured_prefill_times() -> None:
    for shape, tolerance in ((LLAMA3_8B, 0.1), (LLAMA_70B, 1e-9)):
        fit = shape.prefill()
        for tokens, seconds in shape.prefill_points:
            assert fit.seconds(tokens) == pytest.approx(seconds, rel=tolerance)
    assert LLAMA3_8B.kv_bytes_per_token == 128 * KIB
    assert LLAMA_70B.kv_bytes_per_token == 320 * KIB


def test_recompute_is_superlinear_in_the_prefix_already_there() -> None:
    fit = LLAMA_70B.prefill()
    assert fit.recompute_s(4_000, 8_000) > fit.recompute_s(0, 4_000)
    assert fit.recompute_s(100, 100) == 0


def test_negative_quadratic_falls_back_to_linear() -> None:
    fit = fit_prefill([(1_000, 0.010), (2_000, 0.019)])
    assert fit.quadratic_s == 0 and fit.linear_s > 0


def test_default_links_carry_the_mission_figures() -> None:
    assert DEFAULT_LINKS["tcp"].transfer_s(128 * MIB) == pytest.approx(46.8e-3)
    assert DEFAULT_LINKS["rdma"].transfer_s(128 * MIB) == pytest.approx(2.68e-3, rel=0.01)
    assert DEFAULT_LINKS["shm"].setup_s == pytest.approx(0.65e-3)


def test_defaults_pull_over_rdma_but_recompute_an_8b_prefix_over_tcp() -> None:
    cost = CostModel(block_tokens=16)
    blocks = 4_000 // 16  # 500 MB of 8B-shape KV
    assert cost.pull_plan("rdma", 0, blocks).pull
    assert not cost.pull_plan("tcp", 0, blocks).pull  # 183 ms of transfer vs 120 ms
    big = CostModel(block_tokens=16, shape=LLAMA_70B)
    assert big.pull_plan("tcp", 0, blocks).pull  # 70B: 458 ms of transfer vs 970 ms


@given(
    local=st.integers(0, 300),
    extra=st.integers(1, 300),
    block_tokens=st.sampled_from([16, 32, 512]),
    setup_s=st.floats(0, 1e-3),
    shape=st.sampled_from([LLAMA3_8B, LLAMA_70B]),
)
def test_pull_flips_exactly_where_transfer_equals_recompute(
    local: int, extra: int, block_tokens: int, setup_s: float, shape: ModelShape
) -> None:
    probe = CostModel(block_tokens, shape=shape)
    peer = local + extra
    recompute = probe.prefill.recompute_s(local * block_tokens, peer * block_tokens)
    if recompute <= setup_s:
        return
    nbytes = extra * probe.block_bytes()
    even_bw = nbytes / (recompute - setup_s)  # transfer time == recompute time here

    def plan(bw: float) -> bool:
        links = {"x": Link(bw, setup_s)}
        cost = CostModel(block_tokens, shape=shape, links=links)
        p = cost.pull_plan("x", local, peer)
        assert p.pull == (p.transfer_s < p.recompute_s)
        assert p.saved_s == (p.recompute_s - p.transfer_s if p.pull else 0.0)
        return p.pull

    assert plan(even_bw * (1 + 1e-9))
    assert not plan(even_bw * (1 - 1e-9))
    assert not plan(math.nextafter(even_bw, 0) * (1 - 1e-12))


def test_nothing_to_pull_is_never_a_pull() -> None:
    cost = CostModel(block_tokens=16)
    p = cost.pull_plan("shm", 5, 5)
    assert not p.pull and p.blocks == 0 and p.saved_s == 0
