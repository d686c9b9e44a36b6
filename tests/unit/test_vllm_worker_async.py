"""The connector's worker side with saves that complete after their step (the CUDA path).

The mover and the seam are test doubles: the GPU the CUDA mover drives cannot run
here (tests/gpu and bench/results/vllm-gpu-*.md cover it on a GPU), and these
tests are about the worker's ordering and bookkeeping alone:

- a save is announced stored only once its copy completed, and an engine that
  takes no further step still gets it announced (the background announcer);
- a fetched load is reported finished to vLLM before its blocks are announced,
  and a load takes its slots from the save reserve (no Allocate round trip).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvdir.agent.engine.vllm.namespace import KvShape
from kvdir.agent.engine.vllm.seam import Fetched
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
        return Fetched(len(slots), "cuda", len(slots) * 1024)

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
