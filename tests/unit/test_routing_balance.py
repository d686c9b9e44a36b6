"""The balance guard: no policy piles requests onto one hot node (SGLang's death spiral)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvdir.routing import Balance, Candidate, CostModel, Holder, Policy, Prompt, Router, Rule

COST = CostModel(block_tokens=16)
ALL = frozenset({"tcp", "rdma", "shm"})

balances = st.builds(Balance, st.integers(0, 64).map(float), st.floats(1.0, 4.0))
loads = st.lists(st.integers(0, 500).map(float), min_size=1, max_size=8)


def hot_prompt(chain: int = 256) -> Prompt:
    """Node 0 holds the whole chain, the others nothing: affinity wants node 0 every time."""
    return Prompt(chain, {"n0": Holder("n0", chain, "h0", ALL)})


def candidates(ls: list[float]) -> list[Candidate]:
    return [Candidate(f"n{i}", x, f"h{i}", ALL) for i, x in enumerate(ls)]


@given(
    ls=loads,
    balance=balances,
    policy=st.sampled_from(list(Policy)),
    seed=st.integers(0, 2**32),
    hot=st.integers(0, 7),
)
def test_a_decision_never_chooses_a_node_over_the_bound(
    ls: list[float], balance: Balance, policy: Policy, seed: int, hot: int
) -> None:
    """Under any load pattern the chosen node is within the bound of the least loaded."""
    chain = 256
    p = Prompt(chain, {f"n{hot}": Holder(f"n{hot}", chain, f"h{hot}", ALL)})
    r = Router(policy, COST, random.Random(seed), balance)
    d = r.decide(candidates(ls), p)
    assert d.load <= balance.bound(min(ls))
    if balance.imbalanced(ls):
        assert d.rule is Rule.BALANCE and d.load == min(ls)


@given(
    start=loads,
    balance=balances,
    policy=st.sampled_from([Policy.AFFINITY, Policy.AFFINITY_POOL, Policy.ROUND_ROBIN]),
    weights=st.lists(st.integers(1, 4), min_size=1, max_size=120),
    seed=st.integers(0, 2**32),
)
def test_a_sequence_of_decisions_never_exceeds_the_imbalance_bound(
    start: list[float],
    balance: Balance,
    policy: Policy,
    weights: list[int],
    seed: int,
) -> None:
    """From loads within the bound, every load stays <= bound(min) + the largest weight."""
    w_max = max(weights)
    low = min(start)
    ls = [min(x, balance.bound(low)) for x in start]  # a start within the bound
    r = Router(policy, COST, random.Random(seed), balance)
    for w in weights:
        d = r.decide(candidates(ls), hot_prompt())
        ls[int(d.node_id[1:])] += w
        assert max(ls) <= balance.bound(min(ls)) + w_max


def test_pure_affinity_would_spiral_and_the_guard_stops_it() -> None:
    """Without a usable guard every request lands on node 0; with one, they spread."""
    for balance, hot_share in ((Balance(1e9, 1e9), 1.0), (Balance(8, 1.5), 0.5)):
        r = Router(Policy.AFFINITY, COST, random.Random(1), balance)
        ls = [0.0] * 4
        for _ in range(400):
            ls[int(r.decide(candidates(ls), hot_prompt()).node_id[1:])] += 1
        assert ls[0] / 400 <= hot_share
        if hot_share < 1:
            assert max(ls) - min(ls) <= 8 + 1
