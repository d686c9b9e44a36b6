"""Routing policies: pick the node for a prompt from candidates, loads and prefix holders.

Pure logic: no I/O, no clock read unless one is injected, randomness from an
injected `random.Random`. A `Router` holds the only mutable state (the
round-robin cursor); `decide` never mutates the candidates it is given.

Every policy goes through the same balance guard first, in the spirit of
SGLang's `balance_abs_threshold` / `balance_rel_threshold`: when the most
loaded candidate exceeds the least loaded by more than `abs_load` AND by more
than a factor `rel_load`, the choice falls back to the least loaded candidate
(rule `balance`). Consequence (tests/unit/test_routing_balance.py): a chosen
node's load is never above `max(min + abs_load, min * rel_load)`, so with
request weights at most `w` and loads that start within that bound, the most
loaded node never exceeds it by more than `w`. Pure affinity without this
guard is the documented "death spiral": the hot node gets every request.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvdir.routing.cost import CostModel, PullPlan


class Policy(enum.StrEnum):
    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    AFFINITY = "affinity"
    AFFINITY_POOL = "affinity+pool"


class Rule(enum.StrEnum):
    """Which rule decided, for metrics."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    BALANCE = "balance"
    """The balance guard overrode the policy: least loaded among the candidates."""
    NO_HIT = "no-hit"
    """An affinity policy found nothing to save anywhere: least loaded."""
    AFFINITY = "affinity"
    """Best score with blocks local to the chosen node."""
    POOL = "pool"
    """Best score includes blocks pulled from a peer."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node the prompt may go to, with its current load (any unit, e.g. queued requests)."""

    node_id: str
    load: float
    host: str = ""
    transports: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Holder:
    """One node's contiguous prefix of the prompt's chain, from block 0."""

    node_id: str
    prefix_blocks: int
    host: str = ""
    transports: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the router sees it: its chain length and who holds its prefix."""

    chain_blocks: int
    holders: Mapping[str, Holder] = field(default_factory=dict)

    def local_blocks(self, node_id: str) -> int:
        h = self.holders.get(node_id)
        return min(h.prefix_blocks, self.chain_blocks) if h is not None else 0


@dataclass(frozen=True, slots=True)
class Balance:
    """SGLang-style imbalance thresholds (both must be exceeded to intervene)."""

    abs_load: float = 32.0
    rel_load: float = 1.5

    def __post_init__(self) -> None:
        assert self.abs_load >= 0 and self.rel_load >= 1, self

    def bound(self, min_load: float) -> float:
        """The highest load a node may have and still be chosen."""
        return max(min_load + self.abs_load, min_load * self.rel_load)

    def imbalanced(self, loads: Sequence[float]) -> bool:
        return max(loads) > self.bound(min(loads))


@dataclass(frozen=True, slots=True)
class Score:
    """What sending the prompt to one candidate is predicted to save and cost."""

    node_id: str
    local_blocks: int
    pulled_blocks: int
    pull_from: str | None
    transport: str | None
    saved_s: float
    transfer_s: float
    load_penalty_s: float

    @property
    def value(self) -> float:
        return self.saved_s - self.load_penalty_s


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen node and why, for metrics and for telling the node where to pull from."""

    node_id: str
    policy: Policy
    rule: Rule
    local_blocks: int
    pulled_blocks: int
    pull_from: str | None
    transport: str | None
    predicted_saved_s: float
    predicted_transfer_s: float
    load: float
    decide_s: float = 0.0
    """Time the decision took, measured by the injected clock (0 without one)."""


def link_transport(cost: CostModel, src: Holder, dst: Candidate, blocks: int) -> str | None:
    """The fastest transport both ends offer and the cost model knows (shm: same host only)."""
    common = (src.transports & dst.transports) & cost.links.keys()
    if src.host != dst.host or not src.host:
        common -= {"shm"}
    if not common:
        return None
    return min(sorted(common), key=lambda t: cost.transfer_s(t, blocks))


def best_pull(cost: CostModel, prompt: Prompt, dst: Candidate) -> tuple[str, str, PullPlan] | None:
    """The peer, transport and plan that save the most by pulling onto `dst` (None: none)."""
    local = prompt.local_blocks(dst.node_id)
    best: tuple[str, str, PullPlan] | None = None
    for h in sorted(prompt.holders.values(), key=lambda h: h.node_id):
        peer = min(h.prefix_blocks, prompt.chain_blocks)
        if h.node_id == dst.node_id or peer <= local:
            continue
        transport = link_transport(cost, h, dst, peer - local)
        if transport is None:
            continue
        plan = cost.pull_plan(transport, local, peer)
        if plan.pull and (best is None or plan.saved_s > best[2].saved_s):
            best = (h.node_id, transport, plan)
    return best


def score(cost: CostModel, prompt: Prompt, c: Candidate, pool: bool) -> Score:
    """Prefill seconds saved on `c` (local blocks, plus a pull when `pool`) less its load."""
    local = prompt.local_blocks(c.node_id)
    saved = cost.local_saved_s(local)
    penalty = cost.load_penalty_s(c.load)
    pull = best_pull(cost, prompt, c) if pool else None
    if pull is None:
        return Score(c.node_id, local, 0, None, None, saved, 0.0, penalty)
    peer, transport, plan = pull
    return Score(
        c.node_id,
        local,
        plan.blocks,
        peer,
        transport,
        saved + plan.saved_s,
        plan.transfer_s,
        penalty,
    )


class Router:
    """Applies one policy; holds the round-robin cursor, the RNG and the optional clock."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        rng: random.Random,
        balance: Balance | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.policy = policy
        self.cost = cost
        self.balance = balance if balance is not None else Balance()
        self._rng = rng
        self._clock = clock
        self._cursor = 0

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        """Pick one of `candidates` (at least one; node ids unique) for `prompt`."""
        assert candidates, "no candidates"
        assert len({c.node_id for c in candidates}) == len(candidates), "duplicate node ids"
        start = self._clock() if self._clock is not None else 0.0
        pool = self.policy is Policy.AFFINITY_POOL
        scores = {c.node_id: score(self.cost, prompt, c, pool) for c in candidates}
        chosen, rule = self._choose(candidates, scores)
        s = scores[chosen.node_id]
        elapsed = self._clock() - start if self._clock is not None else 0.0
        return Decision(
            chosen.node_id,
            self.policy,
            rule,
            s.local_blocks,
            s.pulled_blocks,
            s.pull_from,
            s.transport,
            s.saved_s,
            s.transfer_s,
            chosen.load,
            elapsed,
        )

    def _choose(
        self, candidates: Sequence[Candidate], scores: Mapping[str, Score]
    ) -> tuple[Candidate, Rule]:
        if self.balance.imbalanced([c.load for c in candidates]):
            return self._least_loaded(candidates, scores), Rule.BALANCE
        if self.policy is Policy.RANDOM:
            return self._rng.choice(list(candidates)), Rule.RANDOM
        if self.policy is Policy.ROUND_ROBIN:
            ordered = sorted(candidates, key=lambda c: c.node_id)
            self._cursor += 1
            return ordered[(self._cursor - 1) % len(ordered)], Rule.ROUND_ROBIN
        if self.policy is Policy.LEAST_LOADED:
            return self._least_loaded(candidates, scores), Rule.LEAST_LOADED
        return self._affinity(candidates, scores)

    def _least_loaded(
        self, candidates: Sequence[Candidate], scores: Mapping[str, Score]
    ) -> Candidate:
        """Least load; ties go to the better score, then to the RNG."""
        low = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == low]
        top = max(scores[c.node_id].saved_s for c in tied)
        return self._pick([c for c in tied if scores[c.node_id].saved_s == top])

    def _affinity(
        self, candidates: Sequence[Candidate], scores: Mapping[str, Score]
    ) -> tuple[Candidate, Rule]:
        if all(scores[c.node_id].saved_s == 0 for c in candidates):
            return self._least_loaded(candidates, scores), Rule.NO_HIT
        top = max(scores[c.node_id].value for c in candidates)
        best = [c for c in candidates if scores[c.node_id].value == top]
        low = min(c.load for c in best)
        chosen = self._pick([c for c in best if c.load == low])
        rule = Rule.POOL if scores[chosen.node_id].pulled_blocks else Rule.AFFINITY
        return chosen, rule

    def _pick(self, tied: Sequence[Candidate]) -> Candidate:
        ordered = sorted(tied, key=lambda c: c.node_id)
        return ordered[0] if len(ordered) == 1 else self._rng.choice(ordered)
