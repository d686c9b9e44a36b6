"""The replay loop: route each request, serve its prefix from cache, pull or recompute.

Requests are taken in arrival order. For each one the router picks a node;
the node's `NodeCache` gives the local prefix; in pool scenarios the backend
finds the longest prefix held by another node (the directory) and, when the
cost model says a pull over the scenario's link beats recomputing, fetches it
(real bytes, validated). Whatever is still missing is recomputed, stored on
the node and announced. Eviction is LRU per node.

Only the GPU is simulated: each node is one FIFO server in simulated time.
A request starts when it has arrived and its node is free, spends the pull's
transfer time (the KV lands before compute starts) and the prefill of its
uncached tokens, and its first token comes out then (TTFT); its decode share
(`GpuModel.decode_s`) keeps the node busy afterwards. Real components are
driven in this order as fast as they go: wall time is not simulated time.
One simplification, documented in docs/replay.md: a request's blocks are
stored and announced when it is dispatched, not when its simulated prefill
ends, so a request arriving during that prefill may already find them.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvdir.replay.cache import NodeCache
from kvdir.replay.gpu import GpuModel
from kvdir.replay.trace import Request
from kvdir.routing.cost import CostModel
from kvdir.routing.policy import Balance, Candidate, Policy, Prompt, Router


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    label: str
    policy: Policy
    link: str | None
    """Cost-model link that times pulls (None: no pool, local cache only)."""
    agent_transports: str
    """What the real agents offer; the bytes of a pull really move over this."""
    modelled: bool = False
    """The timing link is not available on this machine (RDMA): labelled as modelled."""
    always_pull: bool = False
    """Pull whenever a peer has more, as the seed's TCP baseline did, even when the cost
    model says recomputing would be faster (the TTFT then shows what that costs)."""


SCENARIOS: dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario("A", "A: local cache only, random routing", Policy.RANDOM, None, "tcp,shm"),
        Scenario(
            "B", "B: pull over TCP, random routing", Policy.RANDOM, "tcp", "tcp", always_pull=True
        ),
        Scenario(
            "C", "C: pool over shm (one host), random routing", Policy.RANDOM, "shm", "tcp,shm"
        ),
        Scenario(
            "C-rdma",
            "C: pool over RDMA 400 Gbit/s (modelled), random routing",
            Policy.RANDOM,
            "rdma",
            "tcp,shm",
            modelled=True,
        ),
        Scenario(
            "D",
            "D: affinity routing + pool over RDMA 400 Gbit/s (modelled)",
            Policy.AFFINITY_POOL,
            "rdma",
            "tcp,shm",
            modelled=True,
        ),
    )
}


@dataclass(slots=True)
class Pulled:
    """What a backend fetch delivered."""

    valid_blocks: int
    moved_blocks: int
    real_bytes: int = 0
    real_seconds: float = 0.0
    transport: str = ""
    invalidated: int = 0
    wrong_blocks: int = 0
    """Blocks reported valid whose bytes were not the block's: must stay 0."""


class Backend(Protocol):
    """Where the cached blocks really live (agents' pools, or a model of them)."""

    def peer_prefix(self, node: int, chain: Sequence[int], local: int) -> tuple[int, int]:
        """(local blocks the backend sees on `node`, longest prefix another node holds)."""
        ...

    def holders(self, chain: Sequence[int]) -> Prompt:
        """Who holds which prefix of `chain` (for affinity routing)."""
        ...

    def store(self, node: int, chain: Sequence[int], start: int, pull_to: int) -> Pulled | None:
        """Put `chain[start:]` on `node`: pull `chain[start:pull_to]` first when
        `pull_to > start` (None: nothing pulled), then write and announce the rest."""
        ...

    def evict(self, node: int, victims: Sequence[tuple[int, int]]) -> None:
        """`node` drops these (block, slot) pairs."""
        ...

    def slots_of(self, node: int, blocks: Sequence[int]) -> list[int]:
        """Slots the backend put the most recent `store` of these blocks in."""
        ...


@dataclass(slots=True)
class Served:
    """One request's outcome in one scenario."""

    index: int
    node: int
    turn: int
    blocks: int
    reusable: int
    local: int
    pulled: int
    ttft_s: float
    prefill_s: float
    wasted_s: float
    transfer_s: float
    gpu_s: float
    output_tokens: int


@dataclass(slots=True)
class Outcome:
    scenario: str
    served: list[Served] = field(default_factory=list)
    pulls: list[Pulled] = field(default_factory=list)
    model_mismatches: int = 0
    """Requests where the backend's view of the node's cache differed from the model's."""
    busy_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0


class Node:
    """`gpus` FIFO servers (data-parallel engines) sharing one node-level KV cache."""

    def __init__(self, capacity_blocks: int, gpus: int = 1) -> None:
        assert gpus > 0, gpus
        self.cache = NodeCache(capacity_blocks)
        self._free_at = [0.0] * gpus
        """Min-heap of the times each GPU becomes free."""
        self.busy_s = 0.0
        self._done: list[float] = []

    @property
    def free_at(self) -> float:
        return max(self._free_at)

    def load(self, now: float) -> int:
        """Requests dispatched here and not finished by `now` (queued or running)."""
        while self._done and self._done[0] <= now:
            heapq.heappop(self._done)
        return len(self._done)

    def run(self, arrival: float, gpu_first_s: float, gpu_rest_s: float) -> float:
        """Serve on the GPU that frees first, after the queue; returns the first-token time."""
        start = max(arrival, heapq.heappop(self._free_at))
        first = start + gpu_first_s
        end = first + gpu_rest_s
        heapq.heappush(self._free_at, end)
        self.busy_s += gpu_first_s + gpu_rest_s
        heapq.heappush(self._done, end)
        return first


def router_for(scenario: Scenario, gpu: GpuModel, seed: int) -> Router:
    links = {scenario.link: gpu.cost.links[scenario.link]} if scenario.link else {}
    cost = CostModel(gpu.block_tokens, gpu.cost.shape, links, gpu.cost.load_unit_s)
    return Router(scenario.policy, cost, random.Random(seed), Balance())


def _as_linked(prompt: Prompt, link: str | None) -> Prompt:
    """Every holder on its own host reachable over the scenario's link (a real cluster)."""
    t = frozenset({link}) if link else frozenset()
    return replace(
        prompt,
        holders={k: replace(h, host=k, transports=t) for k, h in prompt.holders.items()},
    )


@dataclass(frozen=True, slots=True)
class Setup:
    """The simulated cluster: shape, size, cache capacity, routing seed."""

    gpu: GpuModel
    nodes: int
    capacity_blocks: int
    gpus_per_node: int = 1
    seed: int = 1


class Replay:
    def __init__(self, scenario: Scenario, setup: Setup, backend: Backend) -> None:
        self.scenario = scenario
        self.gpu = setup.gpu
        self.backend = backend
        self.nodes = [Node(setup.capacity_blocks, setup.gpus_per_node) for _ in range(setup.nodes)]
        self.names = [node_name(i) for i in range(setup.nodes)]
        self.router = router_for(scenario, setup.gpu, setup.seed)
        self.out = Outcome(scenario.key)

    def pick(self, r: Request, now: float) -> int:
        link = self.scenario.link
        cands = [
            Candidate(self.names[i], n.load(now), self.names[i], frozenset({link} if link else ()))
            for i, n in enumerate(self.nodes)
        ]
        if self.scenario.policy is Policy.AFFINITY_POOL:
            prompt = _as_linked(self.backend.holders(r.hash_ids), link)
        else:
            prompt = Prompt(len(r.hash_ids))
        return self.names.index(self.router.decide(cands, prompt).node_id)

    def serve(self, r: Request, reusable: int) -> None:
        i = self.pick(r, r.arrival_s)
        node, chain, gpu = self.nodes[i], r.hash_ids, self.gpu
        local = node.cache.prefix(chain)
        seen, peer = self.backend.peer_prefix(i, chain, local)
        if seen != local:
            self.out.model_mismatches += 1
        pull_to, transfer_s = local, 0.0
        if self.scenario.link and peer > local:
            plan = self.router.cost.pull_plan(self.scenario.link, local, min(peer, len(chain)))
            if plan.pull or (self.scenario.always_pull and plan.blocks):
                pull_to, transfer_s = local + plan.blocks, plan.transfer_s
        node.cache.touch(chain[:local])
        self.backend.evict(i, node.cache.make_room(len(chain) - local))
        got = self.backend.store(i, chain, local, pull_to)
        pulled = 0
        if got is not None:
            pulled = got.valid_blocks
            self.out.pulls.append(got)
        node.cache.insert(chain[local:], self.backend.slots_of(i, chain[local:]))
        node.cache.touch(chain)
        hits = local + pulled
        cached = gpu.cached_tokens(hits, r.input_tokens)
        prefill = gpu.prefill_s(cached, r.input_tokens)
        reuse_tokens = gpu.cached_tokens(reusable, r.input_tokens)
        wasted = gpu.prefill_s(cached, max(cached, reuse_tokens))
        decode = gpu.decode_s(r.input_tokens, r.output_tokens)
        first = node.run(r.arrival_s, transfer_s + prefill, decode)
        self.out.served.append(
            Served(
                r.index,
                i,
                r.turn,
                len(chain),
                reusable,
                local,
                pulled,
                first - r.arrival_s,
                prefill,
                wasted,
                transfer_s,
                transfer_s + prefill + decode,
                r.output_tokens,
            )
        )

    def run(
        self,
        requests: Sequence[Request],
        reusable: Sequence[int],
        tick: Callable[[int], None] | None = None,
    ) -> Outcome:
        for k, (r, reuse) in enumerate(zip(requests, reusable, strict=True)):
            self.serve(r, reuse)
            if tick is not None:
                tick(k + 1)
        self.out.busy_s = [n.busy_s for n in self.nodes]
        self.out.makespan_s = max(n.free_at for n in self.nodes) - (
            requests[0].arrival_s if requests else 0.0
        )
        return self.out


def node_name(i: int) -> str:
    return f"node-{i + 1:02d}"


IDEAL = Scenario(
    "ideal", "ideal: infinite global cache (from the trace alone)", Policy.RANDOM, None, ""
)


def ideal(requests: Sequence[Request], reusable: Sequence[int], setup: Setup) -> Outcome:
    """Every reusable block is already on whichever node gets the request, at no cost."""
    replay = Replay(IDEAL, setup, _NoBackend())
    gpu = setup.gpu
    for r, reuse in zip(requests, reusable, strict=True):
        i = replay.pick(r, r.arrival_s)
        cached = gpu.cached_tokens(reuse, r.input_tokens)
        prefill = gpu.prefill_s(cached, r.input_tokens)
        decode = gpu.decode_s(r.input_tokens, r.output_tokens)
        first = replay.nodes[i].run(r.arrival_s, prefill, decode)
        replay.out.served.append(
            Served(
                r.index,
                i,
                r.turn,
                len(r.hash_ids),
                reuse,
                reuse,
                0,
                first - r.arrival_s,
                prefill,
                0.0,
                0.0,
                prefill + decode,
                r.output_tokens,
            )
        )
    replay.out.busy_s = [n.busy_s for n in replay.nodes]
    replay.out.makespan_s = max(n.free_at for n in replay.nodes)
    return replay.out


class _NoBackend:
    def peer_prefix(self, node: int, chain: Sequence[int], local: int) -> tuple[int, int]:
        return local, 0

    def holders(self, chain: Sequence[int]) -> Prompt:
        return Prompt(len(chain))

    def store(self, node: int, chain: Sequence[int], start: int, pull_to: int) -> Pulled | None:
        return None

    def evict(self, node: int, victims: Sequence[tuple[int, int]]) -> None:
        return None

    def slots_of(self, node: int, blocks: Sequence[int]) -> list[int]:
        return [0] * len(blocks)


class ModelBackend:
    """The pool without processes: a global index over the nodes' caches.

    Used for the nodes sweep (labelled as model-only); at the same settings
    its hit counts must equal the real run's under random routing, which the
    replay checks and reports.
    """

    def __init__(self, caches: Callable[[], Sequence[NodeCache]], names: Sequence[str]) -> None:
        self._caches = caches
        self._names = list(names)

    def peer_prefix(self, node: int, chain: Sequence[int], local: int) -> tuple[int, int]:
        best = 0
        for j, c in enumerate(self._caches()):
            if j != node:
                best = max(best, c.prefix(chain))
        return local, best

    def holders(self, chain: Sequence[int]) -> Prompt:
        from kvdir.routing.policy import Holder

        hs = {}
        for j, c in enumerate(self._caches()):
            k = c.prefix(chain)
            if k:
                hs[self._names[j]] = Holder(self._names[j], k)
        return Prompt(len(chain), hs)

    def store(self, node: int, chain: Sequence[int], start: int, pull_to: int) -> Pulled | None:
        if pull_to <= start:
            return None
        return Pulled(pull_to - start, pull_to - start)

    def evict(self, node: int, victims: Sequence[tuple[int, int]]) -> None:
        return None

    def slots_of(self, node: int, blocks: Sequence[int]) -> list[int]:
        return [0] * len(blocks)


def model_replay(
    scenario: Scenario,
    requests: Sequence[Request],
    reusable: Sequence[int],
    setup: Setup,
) -> Outcome:
    holder: list[Replay] = []
    names = [node_name(i) for i in range(setup.nodes)]
    backend = ModelBackend(lambda: [n.cache for n in holder[0].nodes], names)
    replay = Replay(scenario, setup, backend)
    holder.append(replay)
    return replay.run(requests, reusable)
