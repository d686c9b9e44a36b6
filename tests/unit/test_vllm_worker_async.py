"""The connector's worker side with saves that complete after their step (the CUDA path).

The mover and the seam are test doubles: the GPU the CUDA mover drives cannot run
here (tests/gpu and bench/results/vllm-gpu-*.md cover it on a GPU), and these
tests are about the worker's ordering and bookkeeping alone:

- a save is announced stored only once its copy completed, and an engine that
  takes no further step still gets it announced (the background announcer);
- a fetched load is reported finished to vLLM before its blocks are announced,
  and a load takes its slots from the save reserve (no Allocate round trip);
- an inline load (same-host sources) is done when `load_now` returns and the
  same step reports the request finished with its failed blocks; the
  scheduler side inlines only a CUDA engine's same-host loads (pool, cuda,
  shm), and vLLM is told every load is asynchronous.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.namespace import KvShape
from kvdir.agent.engine.vllm.plan import Found
from kvdir.agent.engine.vllm.scheduler import SchedulerSide
from kvdir.agent.engine.vllm.seam import AgentUnavailable, Fetched
from kvdir.agent.engine.vllm.worker import Announce, LoadJob, SaveJob, WorkerSide

WAIT_S = 5.0


def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class LateMover:
    """Saves complete only when the test says so (as a GPU copy completes later)."""

    shape = KvShape(2, (2, 16, 1, 8), "bf16", 2, "cuda", "bknhc")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[Announce] = []
        self.ready: list[Announce] = []
        self.loaded: list[tuple[list[int], list[int]]] = []

    def from_pool(self, slots: Sequence[int], block_ids: Sequence[int], stream: int = 0) -> None:
        self.loaded.append((list(slots), list(block_ids)))

    def to_pool(
        self, block_ids: Sequence[int], slots: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        with self.lock:
            self.pending.append((tuple(hashes), tuple(slots)))
        return True

    def fetched(self, slots: Sequence[int], hashes: Sequence[bytes], transport: str) -> None:
        with self.lock:
            self.pending.append((tuple(hashes), tuple(slots)))

    def complete_all(self) -> None:
        with self.lock:
            self.ready += self.pending
            self.pending = []

    def completed(self) -> list[Announce]:
        with self.lock:
            out, self.ready = self.ready, []
        return out

    @property
    def in_flight(self) -> int:
        with self.lock:
            return len(self.pending)

    def close(self) -> None:
        return


class AgentDouble:
    """The seam's verbs, recorded (the real agent is exercised by tests/vllm)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_slot = 0
        self.reserves = 0
        self.stored_log: list[Announce] = []
        self.on_fetch: Any = None
        self.tickets: list[bytes] = []
        self.valid: int | None = None
        """Blocks a fetch reports valid (None: all of them)."""
        self.found = Found()
        self.lookups = 0
        self.retired = False
        """The fetch answers that a copy into its slots may still land."""
        self.down = False
        """The fetch gets no answer (the agent is gone or hung)."""

    def available(self) -> bool:
        return True

    def reserve(self, count: int) -> list[int]:
        with self.lock:
            self.reserves += 1
            out = list(range(self.next_slot, self.next_slot + count))
            self.next_slot += count
        return out

    def fetch(
        self, chain: Sequence[bytes], skip: int, slots: Sequence[int], ticket: bytes = b""
    ) -> Fetched:
        self.tickets.append(ticket)
        if self.on_fetch is not None:
            self.on_fetch()
        if self.down:
            raise AgentUnavailable("no answer")
        if self.retired:
            return Fetched(0, "cuda", slots_retired=True)
        v = len(slots) if self.valid is None else self.valid
        return Fetched(v, "cuda", v * 1024, invalidated=len(slots) - v)

    def lookup(self, chain: Sequence[bytes]) -> Found:
        self.lookups += 1
        return self.found

    def stored(self, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        with self.lock:
            self.stored_log.append((tuple(hashes), tuple(slots)))

    def release(self, slots: Sequence[int]) -> None:
        return

    def close(self) -> None:
        return


def _worker(reserve: int = 8) -> tuple[WorkerSide, LateMover, AgentDouble]:
    mover, agent = LateMover(), AgentDouble()
    w = WorkerSide(agent, mover, reserve, True)  # type: ignore[arg-type]
    wait_until(lambda: len(w._stash) == reserve, "the save reserve")
    return w, mover, agent


def test_a_save_is_announced_only_after_its_copy_and_without_another_step() -> None:
    w, mover, agent = _worker()
    try:
        w.save([SaveJob((b"h0", b"h1"), (3, 4))])
        assert mover.in_flight == 1 and agent.stored_log == []
        mover.complete_all()  # the copy lands; the engine takes no further step
        wait_until(lambda: agent.stored_log, "the save's announcement")
        ((hashes, slots),) = agent.stored_log
        assert hashes == (b"h0", b"h1") and len(slots) == 2
    finally:
        w.close()


def test_a_fetched_load_finishes_before_its_blocks_are_announced_and_uses_reserved_slots() -> None:
    w, mover, agent = _worker(reserve=8)
    reserves = agent.reserves
    try:
        job = LoadJob("r2", (b"a", b"b", b"c"), 0, (10, 11, 12), (), ticket=b"T")
        w.submit(job)
        wait_until(lambda: mover.loaded, "the load's copy")
        done: set[str] = set()

        def reported() -> bool:
            done.update(w.finished())
            return bool(done)

        wait_until(reported, "the load reported")
        assert done == {"r2"} and w.take_errors() == set()
        assert agent.tickets == [b"T"]  # the lookup's ticket reaches the one fetch
        assert agent.stored_log == []  # not before the staged copies completed
        assert agent.reserves == reserves  # the slots came from the save reserve
        mover.complete_all()
        wait_until(lambda: agent.stored_log, "the fetched blocks' announcement")
        assert agent.stored_log[0][0] == (b"a", b"b", b"c")
    finally:
        w.close()


def test_an_inline_load_lands_before_it_returns_and_this_step_reports_it() -> None:
    w, mover, agent = _worker(reserve=8)
    try:
        agent.valid = 1  # the holder's second block was reused during the read
        job = LoadJob("r3", (b"a", b"b", b"c"), 0, (20, 21, 22), (), ticket=b"T", inline=True)
        w.load_now(job)
        assert mover.loaded and mover.loaded[-1][1] == [20]  # landed before returning
        assert w.finished() == {"r3"}  # this step reports it: the request runs next step
        assert w.take_errors() == {21, 22}
        assert w.drain_stats().recomputed_blocks == 2
    finally:
        w.close()


@pytest.mark.parametrize("how", ["retired", "no answer"])
def test_slots_a_read_may_still_land_in_are_never_handed_out_again(how: str) -> None:
    """A device read that outlived the agent's deadline (slots_retired), or a fetch with
    no answer at all: its slots are not given back to the save reserve, where a save
    would write them while the read may still land (and then announce them stored)."""
    w, _mover, agent = _worker(reserve=8)
    try:
        agent.retired, agent.down = how == "retired", how == "no answer"
        stash = set(w._stash)
        job = LoadJob("r5", (b"a", b"b", b"c"), 0, (30, 31, 32), (), ticket=b"T", inline=True)
        w.load_now(job)
        assert w.finished() == {"r5"} and w.take_errors() == {30, 31, 32}  # recomputed
        taken = stash - set(w._stash)
        assert len(taken) == 3  # the fetch's slots came from the reserve ...
        wait_until(lambda: len(w._stash) >= 8, "the reserve's refill")
        assert not taken & set(w._stash)  # ... and never went back to it
        assert w.drain_stats().retired_slots == 3
    finally:
        w.close()


def test_an_inline_load_that_raises_fails_every_block_and_keeps_the_worker() -> None:
    w, _mover, agent = _worker(reserve=8)
    try:

        def broken() -> None:
            raise RuntimeError("a bug in the fetch path")

        agent.on_fetch = broken
        w.load_now(LoadJob("r4", (b"a", b"b"), 0, (30, 31), (), ticket=b"T", inline=True))
        assert w.finished() == {"r4"} and w.take_errors() == {30, 31}
        agent.on_fetch = None
        w.load_now(LoadJob("r5", (b"a",), 0, (32,), (), ticket=b"T", inline=True))
        assert w.finished() == {"r5"} and w.take_errors() == set()
    finally:
        w.close()


def _planned(cfg: ConnectorConfig, found: Found, cuda: bool = True) -> LoadJob:
    agent = AgentDouble()
    agent.found = found
    chain = [bytes([i]) * 8 for i in range(6)]
    s = SchedulerSide(agent, cfg, 16, 1024, inline_device=cuda)  # type: ignore[arg-type]
    try:
        tokens = None
        for _ in range(100):  # the lookup runs on the scheduler side's pool
            tokens = s.matched("q", chain, 6 * 16 + 5, 0)
            if tokens is not None:
                break
        assert tokens and tokens > 0
        s.allocated("q", chain, list(range(100, 107)), tokens)
        (job,) = s.step({}, lambda _: None).loads
        return job
    finally:
        s._pool.shutdown(wait=True)


@pytest.mark.parametrize(
    ("path", "pool", "inline"),
    [
        ("cuda", 0, True),  # a same-host GPU: on the engine's thread
        ("shm", 0, True),  # a same-host peer's host copy
        ("tcp", 0, False),  # over the network: on the load thread
        ("rdma", 0, False),
        ("host", 0, False),  # the agent has no channel to the holder yet
        ("", 3, True),  # this node's pool only
    ],
)
def test_only_same_host_loads_are_inline(path: str, pool: int, inline: bool) -> None:
    found = Found(tuple(range(pool)), 0 if pool else 6, True, b"" if pool else b"T", path)
    assert _planned(ConnectorConfig(skip_slow_pulls=False), found).inline is inline


def test_a_cpu_engine_loads_on_the_load_thread() -> None:
    cfg = ConnectorConfig(skip_slow_pulls=False)
    assert not _planned(cfg, Found((), 6, True, b"T", "shm"), cuda=False).inline
    assert not _planned(cfg, Found((0, 1, 2), 0, True), cuda=False).inline


def test_inline_loads_off_keeps_every_load_on_the_load_thread() -> None:
    cfg = ConnectorConfig(skip_slow_pulls=False, inline_loads=False)
    assert not _planned(cfg, Found((), 6, True, b"T", "cuda")).inline


def test_an_idle_step_waits_for_a_load_in_flight_and_reports_it() -> None:
    w, _mover, agent = _worker(reserve=8)
    assert w.idle_wait_s == 0.002  # a CUDA engine's (LateMover's shape is cuda)
    release = threading.Event()
    agent.on_fetch = lambda: release.wait(WAIT_S)
    try:
        assert w.finished(idle_step=True) == set()  # nothing in flight: no wait
        w.submit(LoadJob("r6", (b"a", b"b"), 0, (40, 41), (), ticket=b"T"))
        assert w.finished(idle_step=False) == set()  # a step with a forward never waits
        w.idle_wait_s = WAIT_S
        threading.Timer(0.05, release.set).start()
        assert w.finished(idle_step=True) == {"r6"}  # woken by the load's end, same step
        assert w.take_errors() == set()
    finally:
        release.set()
        w.close()


def _settled(s: SchedulerSide, req: str, chain: list[bytes], tokens: int, have: int) -> int:
    """matched() asked until the lookup on the scheduler side's pool settles."""
    for _ in range(200):
        got = s.matched(req, chain, tokens, have)
        if got is not None:
            return got
    raise AssertionError("the lookup never settled")


def test_a_request_vllm_holds_whole_is_answered_without_a_lookup() -> None:
    agent = AgentDouble()
    agent.found = Found((0, 1, 2, 3, 4, 5), 6, True)
    chain = [bytes([i]) * 8 for i in range(6)]
    s = SchedulerSide(agent, ConnectorConfig(), 16, 1024)  # type: ignore[arg-type]
    try:
        # vLLM's own cache has all 6 full blocks of a 101-token prompt.
        assert s.matched("hit", chain, 6 * 16 + 5, 6 * 16) == 0
        assert agent.lookups == 0 and s.counts.lookups_skipped == 1
        s.allocated("hit", chain, list(range(7)), 0)
        # Its cached blocks are not saved again; a seventh, computed now, would be.
        assert s.step({"hit": (6 * 16 + 5, chain)}, lambda _: list(range(7))).saves == []
        # One block short of the loadable ones: the agent is asked.
        assert _settled(s, "part", chain, 6 * 16 + 5, 5 * 16) == 16
        assert agent.lookups == 1 and s.counts.lookups_skipped == 1
    finally:
        s._pool.shutdown(wait=True)


def test_a_loaded_requests_timeline_is_logged_as_it_reaches_a_forward_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = AgentDouble()
    agent.found = Found((), 6, True, b"T", "cuda")
    chain = [bytes([i]) * 8 for i in range(6)]
    ticks = iter(range(0, 10_000, 2))  # each reading of the clock 2 ms later
    cfg = ConnectorConfig(skip_slow_pulls=False)
    s = SchedulerSide(agent, cfg, 16, 1024, lambda: next(ticks) / 1e3)  # type: ignore[arg-type]
    try:
        tokens = _settled(s, "q", chain, 6 * 16 + 5, 0)
        s.allocated("q", chain, list(range(100, 107)), tokens)
        (job,) = s.step({}, lambda _: None).loads  # the step that loads it
        assert job.allocated_at > 0
        s.step({}, lambda _: None)  # an empty step
        s.load_reported(["q", "other"])
        with caplog.at_level("INFO", logger="kvdir.vllm"):
            s.step({"q": (101, chain)}, lambda _: None)  # its first forward pass
            s.step({"q": (102, chain)}, lambda _: None)  # logged once
        (line,) = [r.getMessage() for r in caplog.records if "kvdir timeline" in r.getMessage()]
        assert "lookup settled" in line and "load allocated +" in line
        assert "2 steps after allocation; forward pass" in line  # reported after 2 steps
        assert "and 3 steps after allocation" in line  # ran in the third
    finally:
        s._pool.shutdown(wait=True)
