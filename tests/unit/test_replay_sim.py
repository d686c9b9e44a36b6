"""The replay loop over the model backend: queues, routing, pulls, figures, targets."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest

from kvdir.replay import results
from kvdir.replay.gpu import GpuModel
from kvdir.replay.progress import Progress
from kvdir.replay.sim import SCENARIOS, Node, Setup, ideal, model_replay
from kvdir.replay.trace import Request, recover_turns, reusable_blocks, synthesize

G70 = GpuModel.of("llama-70b", 512, 32)


def _trace() -> list[Request]:
    return synthesize(conversations=40, seed=11, duration_s=300)


def _hit(rows: Sequence[dict[str, object]], key: str) -> float:
    row = next(r for r in rows if r["scenario"] == key)
    v = row["hit_rate"]
    assert isinstance(v, float)
    return v


def test_node_is_fifo_per_gpu_and_counts_load() -> None:
    n = Node(10, gpus=1)
    assert n.run(0.0, 2.0, 1.0) == 2.0  # first token at 2, busy until 3
    assert n.run(1.0, 1.0, 0.0) == 4.0  # waits for the GPU
    assert n.load(3.5) == 1 and n.load(4.0) == 0
    two = Node(10, gpus=2)
    assert two.run(0.0, 5.0, 0.0) == 5.0
    assert two.run(1.0, 1.0, 0.0) == 2.0  # the second GPU is free
    assert two.busy_s == 6.0


def test_ideal_hits_every_reusable_block_and_a_single_node_needs_no_pool() -> None:
    rs = _trace()
    ru = reusable_blocks(rs)
    setup = Setup(G70, 4, 10_000, 1, seed=2)
    rows = [results.summarize(ideal(rs, ru, setup), G70, 4)]
    assert _hit(rows, "ideal") == 1.0
    one = Setup(G70, 1, 10_000, 1, seed=2)
    a = results.summarize(model_replay(SCENARIOS["A"], rs, ru, one), G70, 1)
    assert a["hit_rate"] == 1.0  # one node with room for everything: local is global
    assert results.expected_local_hit_rate(rs, ru, 1) == 1.0


def test_pool_scenarios_beat_local_only_and_never_exceed_reusable() -> None:
    rs = _trace()
    ru = reusable_blocks(rs)
    setup = Setup(G70, 8, 10_000, 1, seed=5)
    out = {k: model_replay(SCENARIOS[k], rs, ru, setup) for k in SCENARIOS}
    rows = [results.summarize(o, G70, 8) for o in out.values()]
    for o in out.values():
        assert all(x.local + x.pulled <= x.reusable for x in o.served)
        assert all(x.ttft_s >= x.prefill_s + x.transfer_s - 1e-9 for x in o.served)
    assert _hit(rows, "A") < 0.7 < _hit(rows, "C")
    # Same seed, random routing, no capacity pressure: identical hits for B, C, C-rdma.
    assert _hit(rows, "B") == _hit(rows, "C") == _hit(rows, "C-rdma") == 1.0
    by = {r["scenario"]: r for r in rows}
    assert by["A"]["wasted_prefill_fraction"] > by["C"]["wasted_prefill_fraction"] == 0.0
    assert by["A"]["bytes_moved_model"] == 0 < by["C"]["bytes_moved_model"]


def test_tcp_baseline_pulls_even_where_the_cost_model_would_recompute() -> None:
    g8 = GpuModel.of("llama-3-8b", 512, 32)  # with the 8B shape TCP is slower than recompute
    rs = _trace()
    ru = reusable_blocks(rs)
    setup = Setup(g8, 8, 10_000, 1, seed=5)
    b = model_replay(SCENARIOS["B"], rs, ru, setup)
    assert sum(x.pulled for x in b.served) > 0
    pulled = [x for x in b.served if x.pulled]
    assert all(x.transfer_s > 0 for x in pulled)


def test_lru_capacity_limits_the_pool() -> None:
    rs = _trace()
    ru = reusable_blocks(rs)
    longest = max(len(r.hash_ids) for r in rs)
    big = model_replay(SCENARIOS["C"], rs, ru, Setup(G70, 4, 10_000, 1))
    small = model_replay(SCENARIOS["C"], rs, ru, Setup(G70, 4, longest, 1))
    assert results.summarize(small, G70, 4)["hit_rate"] < results.summarize(big, G70, 4)["hit_rate"]


def test_turns_and_figures_in_the_summary() -> None:
    rs = _trace()
    ru = reusable_blocks(rs)
    row = results.summarize(
        model_replay(SCENARIOS["C-rdma"], rs, ru, Setup(G70, 4, 10_000, 2)), G70, 8
    )
    assert row["requests_by_turn"]["1"] == 40
    assert sum(row["requests_by_turn"].values()) == len(rs)
    assert row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert row["per_128mb_s"] == pytest.approx(128e6 / 50e9)
    assert row["throughput_tok_s"] > 0
    md = results.main_table([row])
    assert "RDMA 400 Gbit/s (modelled)" in md
    assert "turn 6+" in results.turn_table([row]) or max(r.turn for r in rs) < 6


def test_expected_local_hit_rate_is_the_uniform_routing_probability() -> None:
    # Request 2 reuses block 0 (carried by two earlier requests) and block 1 (one).
    rs = recover_turns(
        [
            Request(0, 0, 512, 1, (0,)),
            Request(0, 1, 1024, 1, (0, 1)),
            Request(0, 2, 1536, 1, (0, 1, 2)),
        ]
    )
    ru = reusable_blocks(rs)
    assert ru == [0, 1, 2]
    n = 4
    want = ((1 - (3 / 4) ** 1) + (1 - (3 / 4) ** 2) + (1 - (3 / 4) ** 1)) / 3
    assert results.expected_local_hit_rate(rs, ru, n) == pytest.approx(want)


def _row(key: str, hit: float, p99: float, wrong: int = 0) -> dict[str, object]:
    return {
        "scenario": key,
        "hit_rate": hit,
        "ttft_p99_s": p99,
        "real": {"fetches": 1, "wrong_blocks": wrong},
    }


def test_targets_pass_and_fail_on_the_numbers() -> None:
    rows = [
        _row("A", 0.10, 9.0),
        _row("C", 0.96, 5.0),
        _row("C-rdma", 0.90, 5.0),
        _row("D", 0.97, 4.0),
        _row("ideal", 1.0, 3.0),
    ]
    t = {x.key: x.passed for x in results.targets(rows, expected_a=0.12)}
    assert t == {
        "hit_gap_C": True,
        "hit_gap_C-rdma": False,
        "a_vs_expected": True,
        "d_p99_vs_C-rdma": True,
        "d_p99_vs_C": True,
        "wrong_blocks": True,
    }
    rows[3] = _row("D", 0.97, 5.0, wrong=1)
    t = {x.key: x.passed for x in results.targets(rows, expected_a=0.30)}
    assert not t["d_p99_vs_C"] and not t["wrong_blocks"] and not t["a_vs_expected"]


def test_progress_bar_redraws_on_an_injected_clock() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress("C", 100, stream=out, interval_s=0.5, clock=lambda: now[0])
    bar(1)
    assert out.getvalue() == ""  # too soon
    now[0] = 20.0
    bar(50)
    bar(51)  # rate-limited
    now[0] = 40.0
    bar(100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "50/100" in lines[0] and "50.0%" in lines[0]
    assert "100/100" in lines[1] and "100.0%" in lines[1]
