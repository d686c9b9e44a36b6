"""Scheduler side: bounded lookups and the per-step load/save metadata.

`matched` answers get_num_new_matched_tokens. The first call for a request
starts one lookup (local pool + directory, through the agent) on a small
thread pool and waits at most lookup_wait_ms; while it is pending the answer
is None ("ask again next step"), and past lookup_timeout_ms it is 0. An
agent or directory that is down therefore costs a request at most
lookup_timeout_ms of waiting (then agent_retry_s of immediate zeros), and
never blocks the scheduler loop longer than lookup_wait_ms per call. The
answer is cached per request, so repeated calls are free and consistent.

Every load is asynchronous for vLLM (the request waits in
WAITING_FOR_REMOTE_KVS). On a CUDA engine (`inline_device`) a load whose
sources are all on this host (this node's pool; a same-host peer over CUDA
IPC or shared memory: copies, not network round trips) is done on the
engine's thread as the step that allocated it starts, and reported finished
by that same step, so the request runs in the next one without the engine
spinning empty steps for it; a load over the network (tcp, rdma) runs on the
worker's load thread while other requests keep running. A CPU engine loads
on the load thread only: its copies are CPU work, and on vLLM 0.32's CPU
engine thread they took 4-11x as long as on the load thread (28-89 ms against
7-8 ms for 4-8 MiB; measured, not explained: that thread runs vLLM's OpenMP
team). Not vLLM's synchronous loads: vLLM 0.24 schedules the next step before
it learns that a synchronous load failed (async scheduling, its default), and
on the H200 a request whose synchronous load failed validation then answered
differently from recompute (bench/results/vllm-gpu-2026-12-04-sync.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.plan import (
    NOTHING,
    Found,
    LoadPlan,
    PullCost,
    SavePlanner,
    loadable_blocks,
    plan_load,
    pool_only,
)
from kvdir.agent.engine.vllm.seam import AgentSeam, AgentUnavailable
from kvdir.agent.engine.vllm.worker import LoadJob, SaveJob

log = logging.getLogger("kvdir.vllm")

LOOKUP_THREADS = 2
PENDING_LOOKUPS_MAX = 1024
TIMELINES_MAX = 4096
"""Requests whose timeline (first seen -> forward pass) is kept until it is logged."""
INLINE_PATHS = frozenset({"cuda", "shm"})
"""What a peer is read over (EngineLookupResponse.fetch_path) when a load is inline."""


@dataclass(slots=True)
class _Stamps:
    """When a lookup's thread began and when the agent's answer reached it (clock
    readings written by that thread before its future completes)."""

    ran: float | None = None
    returned: float | None = None


@dataclass(slots=True)
class _Pending:
    future: Future[Found]
    started: float
    stamps: _Stamps


@dataclass(slots=True)
class _Timeline:
    """When the scheduler side saw one request reach each point (its clock), logged
    once as the request first enters a forward pass: where a loaded request's
    time goes between vLLM's first question and its forward pass."""

    seen: float
    calls: int = 1
    """Scheduler calls that asked about the request before its lookup settled."""
    answered: float | None = None
    lookup: _Stamps | None = None
    """Inside the lookup: its thread's start and the agent's answer."""
    allocated: float | None = None
    reported: float | None = None
    """When the workers' output said its load ended (update_connector_output)."""
    steps: int = 0
    """Steps built since its allocation (the one that started the load is 1)."""
    reported_steps: int = 0
    skipped: bool = False
    """Not looked up: vLLM's own cache held every block a load could bring."""


@dataclass(slots=True)
class StepMeta:
    """What one step's workers do: loads to start, blocks to save."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    tokens: int = 0
    """Tokens this step computes (the worker times prefill-sized steps for PullCost)."""


@dataclass(slots=True)
class LookupCounts:
    lookups: int = 0
    timeouts: int = 0
    agent_down: int = 0
    slow_pulls_skipped: int = 0
    lookups_skipped: int = 0
    """Requests whose every loadable block vLLM's own cache held: not looked up."""


class SchedulerSide:
    def __init__(
        self,
        seam: AgentSeam,
        cfg: ConnectorConfig,
        block_tokens: int,
        block_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        inline_device: bool = False,
    ) -> None:
        self.seam = seam
        self.cfg = cfg
        self.inline_device = inline_device and cfg.inline_loads
        """Same-host loads run on the engine's thread (a CUDA engine, inline_loads on)."""
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.cost = PullCost()
        self._pull_ok: dict[str, bool] = {}
        """Per request: the pull-vs-recompute decision, taken once, at its first plan."""
        self.clock = clock
        self.counts = LookupCounts()
        self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvdir-lookup")
        self._pending: dict[str, _Pending] = {}
        self._found: dict[str, Found] = {}
        self._lookup_s: dict[str, float] = {}
        """Per request: how long its lookup took as the scheduler saw it (logged once)."""
        self._vllm_blocks: dict[str, int] = {}
        """Per request not looked up: the leading blocks vLLM's own cache held."""
        self._timelines: dict[str, _Timeline] = {}
        self._loading: dict[str, _Timeline] = {}
        """The timelines of requests whose load was allocated (steps are counted)."""
        self._plans: dict[str, tuple[LoadPlan, Found]] = {}
        self._loads: list[LoadJob] = []
        self._attempted: set[str] = set()
        self.saves = SavePlanner(block_tokens)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lookups

    def _lookup(self, chain: tuple[bytes, ...], stamps: _Stamps) -> Found:
        stamps.ran = self.clock()
        try:
            return self.seam.lookup(chain)
        except AgentUnavailable:
            self.counts.agent_down += 1
            return NOTHING
        finally:
            stamps.returned = self.clock()

    def found(self, req_id: str, chain: Sequence[bytes]) -> Found | None:
        """The lookup's answer, NOTHING when it cannot be had in time, None while pending."""
        done = self._found.get(req_id)
        if done is not None:
            return done
        p = self._pending.get(req_id)
        if p is None:
            if not chain or not self.seam.available() or len(self._pending) >= PENDING_LOOKUPS_MAX:
                return self._settle(req_id, NOTHING)
            self.counts.lookups += 1
            stamps = _Stamps()
            p = self._pending[req_id] = _Pending(
                self._pool.submit(self._lookup, tuple(chain), stamps), self.clock(), stamps
            )
        try:
            got = p.future.result(self.cfg.lookup_wait_ms / 1000)
        except TimeoutError:
            pass
        else:
            self._lookup_s[req_id] = self.clock() - p.started
            t = self._timelines.get(req_id)
            if t is not None:
                t.lookup = p.stamps
            return self._settle(req_id, got)
        waited = self.clock() - p.started
        if waited >= self.cfg.lookup_timeout_ms / 1000:
            self.counts.timeouts += 1
            self._lookup_s[req_id] = waited  # logged as "no answer in ..."
            return self._settle(req_id, NOTHING)
        return None

    def _settle(self, req_id: str, found: Found) -> Found:
        self._pending.pop(req_id, None)
        self._found[req_id] = found
        t = self._timelines.get(req_id)
        if t is not None:
            t.answered = self.clock()
        return found

    def matched(
        self, req_id: str, chain: Sequence[bytes], num_tokens: int, computed_tokens: int
    ) -> int | None:
        """External tokens to load beyond `computed_tokens` (None: ask again)."""
        if req_id in self._attempted:
            return 0  # one load per request: after a failed one vLLM recomputes locally
        t = self._timelines.get(req_id)
        if t is not None:
            t.calls += int(t.answered is None)
        elif len(self._timelines) < TIMELINES_MAX and req_id not in self._found:
            t = self._timelines[req_id] = _Timeline(self.clock())
        if req_id not in self._found and req_id not in self._pending:
            have = computed_tokens // self.block_tokens
            loadable = loadable_blocks(len(chain), num_tokens, self.block_tokens)
            if have >= loadable:
                # vLLM's own cache holds every block a load could bring: answered
                # without the agent, so a local hit never waits on a lookup.
                if loadable and req_id not in self._vllm_blocks:
                    self.counts.lookups_skipped += 1
                self._vllm_blocks[req_id] = have
                if t is not None:
                    t.skipped = True
                return 0
        found = self.found(req_id, chain)
        if found is None:
            return None
        plan = plan_load(
            found,
            len(chain),
            num_tokens,
            self.block_tokens,
            computed_tokens,
            self.cfg.min_load_blocks,
        )
        if self.cfg.skip_slow_pulls and self.block_bytes and plan.peer_blocks > 0:
            ok = self._pull_ok.get(req_id)
            if ok is None:
                peer = plan.peer_blocks
                ok = self.cost.pull_wins(peer * self.block_bytes, peer * self.block_tokens)
                self._pull_ok[req_id] = ok
                if not ok:
                    self.counts.slow_pulls_skipped += 1
            if not ok:
                plan = pool_only(plan, self.block_tokens)
        if req_id not in self._plans:
            log.info(
                "kvdir lookup: request %s, %d blocks, vLLM has %d tokens, pool %d blocks, "
                "peers %d blocks (%s in %.2f ms, path %s): load %d tokens%s",
                req_id,
                len(chain),
                computed_tokens,
                found.pool_blocks,
                found.peer_blocks,
                "answered" if found.answered else "no answer",
                self._lookup_s.pop(req_id, 0.0) * 1e3,
                found.path or "-",
                plan.tokens,
                " inline" if plan.tokens and self._inline(plan, found) else "",
            )
        self._plans[req_id] = (plan, found)
        return plan.tokens

    def _inline(self, plan: LoadPlan, found: Found) -> bool:
        """Whether this load runs on the engine's thread (see the module docstring)."""
        return self.inline_device and (plan.peer_blocks == 0 or found.path in INLINE_PATHS)

    # ------------------------------------------------------- allocation

    def allocated(
        self, req_id: str, chain: Sequence[bytes], block_ids: Sequence[int], external: int
    ) -> None:
        """vLLM allocated `block_ids` (the request's whole table) for `external` tokens."""
        entry = self._plans.get(req_id)
        found = entry[1] if entry else NOTHING
        if external <= 0 or entry is None:
            # Nothing to load: what the pool holds is known, the rest is saved as
            # computed. A request not looked up starts past what vLLM had cached:
            # those blocks went to the pool when they were computed, and a local hit
            # does not copy them again.
            if req_id not in self.saves.cursors:
                known = self._vllm_blocks.get(req_id)
                if known is None:
                    known = found.pool_blocks if found.answered else 0
                self.saves.admit(req_id, known)
            return
        now = self.clock()
        t = self._timelines.get(req_id)
        if t is not None:
            t.allocated = now
            self._loading[req_id] = t
        plan = entry[0]
        # vLLM may trim what we offered; a partly promised block is loaded whole.
        want = plan.start_block * self.block_tokens + external
        end = min(plan.end_block, -(-want // self.block_tokens))
        job = LoadJob(
            req_id=req_id,
            hashes=tuple(chain[:end]),
            start_block=plan.start_block,
            block_ids=tuple(block_ids[plan.start_block : end]),
            pool_slots=found.pool_slots,
            ticket=found.ticket if plan.peer_blocks > 0 else b"",
            inline=self._inline(plan, found),
            allocated_at=now,
        )
        self._loads.append(job)
        self._attempted.add(req_id)
        # Loaded blocks end up in the pool (fetched ones are kept there too).
        self.saves.admit(req_id, end)

    def source_tokens(self, req_id: str) -> tuple[int, int]:
        """(tokens expected from this node's pool, from peers) of the request's load."""
        entry = self._plans.get(req_id)
        if entry is None:
            return 0, 0
        plan = entry[0]
        pool = plan.from_pool * self.block_tokens
        return pool, plan.tokens - pool

    # --------------------------------------------------------------- steps

    def step(
        self,
        scheduled: dict[str, tuple[int, Sequence[bytes]]],
        block_ids: Callable[[str], Sequence[int] | None],
    ) -> StepMeta:
        """This step's metadata. `scheduled`: req id -> (tokens computed after
        this step, the request's block hashes)."""
        meta = StepMeta(loads=self._loads)
        self._loads = []
        self._step_timelines(scheduled)
        if not self.cfg.save:
            return meta
        for req_id, (done, hashes) in scheduled.items():
            _first, due = self.saves.due(req_id, hashes, done)
            if not due:
                continue
            ids = block_ids(req_id)
            if ids is None:
                continue
            due = [i for i in due if i < len(ids)]
            meta.saves.append(SaveJob(tuple(hashes[i] for i in due), tuple(ids[i] for i in due)))
        return meta

    def load_reported(self, req_ids: Iterable[str]) -> None:
        """The workers' output of a step said these requests' loads ended."""
        now = self.clock()
        for req_id in req_ids:
            t = self._timelines.get(req_id)
            if t is not None and t.reported is None:
                t.reported, t.reported_steps = now, t.steps

    def _step_timelines(self, scheduled: Mapping[str, object]) -> None:
        """Count this step for loading requests; log and drop the timelines of the
        requests it runs (their first forward pass)."""
        for loading in self._loading.values():
            loading.steps += 1
        for req_id in scheduled:
            t = self._timelines.pop(req_id, None)
            if t is None:
                continue
            self._loading.pop(req_id, None)
            # Loads at INFO (where a pulled request's time goes); the rest at DEBUG.
            level = logging.INFO if t.allocated is not None else logging.DEBUG
            if log.isEnabledFor(level):
                log.log(level, "kvdir timeline: request %s: %s", req_id, _describe(t, self.clock()))

    def finished(self, req_id: str) -> None:
        self._found.pop(req_id, None)
        self._lookup_s.pop(req_id, None)
        self._vllm_blocks.pop(req_id, None)
        self._timelines.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._pull_ok.pop(req_id, None)
        self._attempted.discard(req_id)
        self.saves.forget(req_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.seam.close()


def _ms(a: float, b: float) -> str:
    return f"{(b - a) * 1e3:.2f} ms"


def _describe(t: _Timeline, now: float) -> str:
    """One request's path from vLLM's first question to its first forward pass."""
    if t.skipped:
        parts = ["no lookup (vLLM's cache held every loadable block)"]
    elif t.answered is None:
        parts = [f"lookup unsettled after {t.calls} scheduler calls"]
    else:
        parts = [f"lookup settled {_ms(t.seen, t.answered)} over {t.calls} scheduler calls"]
        st = t.lookup
        if st is not None and st.ran is not None and st.returned is not None:
            # Where it waited: for a thread of the pool, for the agent, for the scheduler
            # thread to take the answer (each of the three needs the engine's GIL).
            parts[0] += (
                f" (thread +{_ms(t.seen, st.ran)}, agent call {_ms(st.ran, st.returned)}, "
                f"taken +{_ms(st.returned, t.answered)})"
            )
    if t.allocated is not None:
        parts.append(f"load allocated +{_ms(t.seen, t.allocated)}")
        if t.reported is not None:
            parts.append(
                f"its end reported {_ms(t.allocated, t.reported)} and "
                f"{t.reported_steps} steps after allocation"
            )
        parts.append(f"forward pass {_ms(t.allocated, now)} and {t.steps} steps after allocation")
    parts.append(f"{_ms(t.seen, now)} after first seen")
    return "; ".join(parts)
