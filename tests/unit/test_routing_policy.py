"""Routing policies: affinity, pool, baselines, explanations and determinism."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from kvdir import routing
from kvdir.routing import (
    Balance,
    Candidate,
    CostModel,
    Holder,
    Policy,
    Prompt,
    Router,
    Rule,
)

COST = CostModel(block_tokens=16)
ALL = frozenset({"tcp", "rdma", "shm"})


def cands(*loads: float, host: str = "", transports: frozenset[str] = ALL) -> list[Candidate]:
    return [Candidate(f"n{i}", load, host or f"h{i}", transports) for i, load in enumerate(loads)]


def prompt(chain: int, **prefixes: int) -> Prompt:
    holders = {n: Holder(n, b, f"h{n[1:]}", ALL) for n, b in prefixes.items()}
    return Prompt(chain, holders)


def router(
    policy: Policy,
    seed: int = 0,
    balance: Balance | None = None,
    clock: Callable[[], float] | None = None,
) -> Router:
    return Router(policy, COST, random.Random(seed), balance, clock)


def test_public_api_is_pinned() -> None:
    assert sorted(routing.__all__) == sorted(
        [
            "DEFAULT_LINKS", "DEFAULT_WEIGHTS", "LLAMA3_8B", "LLAMA_70B", "SHAPES", "Balance",
            "Candidate", "CostModel", "Decision", "EngineLoad", "Holder", "Link", "LoadWeights",
            "ModelShape", "Policy", "PrefillFit", "Prompt", "PullPlan", "Router", "Rule", "Score",
            "backend_load", "fit_prefill", "score",
        ]
    )  # fmt: skip


@given(
    prefixes=st.lists(st.integers(0, 400), min_size=1, max_size=8),
    load=st.integers(0, 20),
    pool=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_affinity_picks_the_longest_prefix_when_loads_are_equal(
    prefixes: list[int], load: int, pool: bool, seed: int
) -> None:
    chain = 400
    p = prompt(chain, **{f"n{i}": b for i, b in enumerate(prefixes)})
    policy = Policy.AFFINITY_POOL if pool else Policy.AFFINITY
    d = router(policy, seed).decide(cands(*[load] * len(prefixes)), p)
    longest = max(prefixes)
    if longest == 0:
        assert d.rule is Rule.NO_HIT
        return
    assert p.local_blocks(d.node_id) == longest
    assert d.local_blocks == longest
    assert d.predicted_saved_s >= COST.local_saved_s(longest)
    assert d.rule in (Rule.AFFINITY, Rule.POOL)


def test_load_penalty_trades_against_prefix() -> None:
    p = prompt(250, n0=250, n1=0)
    # n0 saves ~120 ms; 2 queued requests cost 2 x 119 ms there.
    assert router(Policy.AFFINITY).decide(cands(2, 0), p).node_id == "n1"
    assert router(Policy.AFFINITY).decide(cands(1, 0), p).node_id == "n0"


def test_pool_pulls_over_rdma_and_explains_it() -> None:
    p = prompt(250, n0=250)
    d = router(Policy.AFFINITY_POOL).decide(cands(5, 0), p)
    assert d.node_id == "n1" and d.rule is Rule.POOL
    assert (d.local_blocks, d.pulled_blocks, d.pull_from, d.transport) == (0, 250, "n0", "rdma")
    plan = COST.pull_plan("rdma", 0, 250)
    assert d.predicted_saved_s == plan.saved_s
    assert d.predicted_transfer_s == plan.transfer_s
    assert d.load == 0 and d.policy is Policy.AFFINITY_POOL


def test_pool_recomputes_when_only_tcp_links_the_nodes() -> None:
    tcp = frozenset({"tcp"})
    p = Prompt(250, {"n0": Holder("n0", 250, "h0", tcp)})
    d = router(Policy.AFFINITY_POOL).decide(cands(5, 0, transports=tcp), p)
    assert d.node_id == "n1" and d.rule is Rule.AFFINITY  # local: nothing; pull: not worth it
    assert d.pulled_blocks == 0 and d.pull_from is None


def test_pool_tops_up_a_shorter_local_prefix_over_shm_on_one_host() -> None:
    p = Prompt(
        250,
        {
            "n0": Holder("n0", 250, "same", ALL),
            "n1": Holder("n1", 100, "same", ALL),
        },
    )
    d = router(Policy.AFFINITY_POOL).decide(cands(9, 0, host="same"), p)
    assert (d.node_id, d.local_blocks, d.pulled_blocks, d.transport) == ("n1", 100, 150, "shm")


def test_pool_ignores_holders_without_a_common_transport() -> None:
    p = Prompt(250, {"n0": Holder("n0", 250, "h0", frozenset({"rdma"}))})
    d = router(Policy.AFFINITY_POOL).decide(cands(5, 0, transports=frozenset({"tcp"})), p)
    assert d.pulled_blocks == 0 and d.node_id == "n1"


def test_holder_longer_than_the_chain_counts_only_the_chain() -> None:
    p = prompt(10, n0=50)
    assert router(Policy.AFFINITY).decide(cands(0, 0), p).local_blocks == 10


def test_round_robin_cycles_in_node_order() -> None:
    r = router(Policy.ROUND_ROBIN)
    picks = [r.decide(cands(0, 0, 0)[::-1], prompt(4)).node_id for _ in range(6)]
    assert picks == ["n0", "n1", "n2", "n0", "n1", "n2"]


def test_least_loaded_prefers_the_hit_among_equal_loads() -> None:
    d = router(Policy.LEAST_LOADED).decide(cands(3, 1, 1), prompt(8, n2=8))
    assert (d.node_id, d.rule, d.local_blocks) == ("n2", Rule.LEAST_LOADED, 8)


def test_no_hit_goes_to_the_least_loaded() -> None:
    d = router(Policy.AFFINITY_POOL).decide(cands(3, 1, 2), prompt(8))
    assert (d.node_id, d.rule) == ("n1", Rule.NO_HIT)


def test_decision_time_comes_from_the_injected_clock() -> None:
    ticks = iter([10.0, 10.25])
    d = router(Policy.RANDOM, clock=lambda: next(ticks)).decide(cands(0, 0), prompt(1))
    assert d.decide_s == 0.25
    assert router(Policy.RANDOM).decide(cands(0, 0), prompt(1)).decide_s == 0.0


@given(
    seed=st.integers(0, 2**32),
    policy=st.sampled_from(list(Policy)),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 50), min_size=3, max_size=3), st.integers(0, 3)),
        max_size=20,
    ),
)
def test_same_seed_same_decisions(
    seed: int, policy: Policy, steps: list[tuple[list[int], int]]
) -> None:
    def run() -> list[routing.Decision]:
        r = router(policy, seed, balance=Balance(abs_load=8, rel_load=1.5))
        return [r.decide(cands(*loads), prompt(64, n0=4 * k, n1=8 * k)) for loads, k in steps]

    assert run() == run()


def test_random_spreads_over_every_candidate() -> None:
    r = router(Policy.RANDOM, seed=7)
    seen = {r.decide(cands(0, 0, 0, 0), prompt(4)).node_id for _ in range(200)}
    assert seen == {"n0", "n1", "n2", "n3"}
