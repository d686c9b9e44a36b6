"""Worker side: validated loads into vLLM's blocks, and saves into the node's pool.

Load (asynchronous for vLLM: the request waits in WAITING_FOR_REMOTE_KVS and
the forward pass never reads blocks still loading): on a background thread,
or inline (`load_now`: a CUDA engine's same-host sources, device copies rather
than round trips) on the engine's thread as the step starts, reported
finished by that same step:
1. blocks this node's pool holds are copied pool -> vLLM blocks seqlock style:
   slot headers read before and after the copy must be equal, STORED, with the
   block's hash; the first block that fails ends the local part;
2. the rest is fetched by the agent from the best peer into reserved pool
   slots, on the load ticket of the scheduler side's lookup (the agent reads
   the holders it names without asking the directory again; validated
   against the holder's headers after the read, as for every fetch) and
   copied into vLLM blocks; those slots are
   then announced stored, so the fetched blocks stay in the pool and are
   published;
3. every vLLM block past the valid prefix is reported as a load error, so
   vLLM recomputes it (kv_load_failure_policy="recompute").

Save (wait_for_save, after the step's forward): full blocks computed this step
are gathered into slots reserved ahead by a refill thread and announced stored
(queued; the agent publishes asynchronously). With no reserved slot at hand a
block is skipped and counted: a future miss, never a wait.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvdir.agent.engine.vllm.namespace import KvShape
from kvdir.agent.engine.vllm.seam import AgentSeam, AgentUnavailable
from kvdir.agent.pool import STORED, read_header

Announce = tuple[tuple[bytes, ...], tuple[int, ...]]
"""(hashes, slots) whose bytes are in the pool: to be announced stored."""


class Mover(Protocol):
    """Moves blocks between vLLM's caches and the pool: kvcopy.BlockCopier (CPU,
    synchronous) or kvcopy_cuda.CudaCopier (CUDA, saves complete later)."""

    shape: KvShape

    def from_pool(self, slots: Sequence[int], block_ids: Sequence[int], stream: int = 0) -> None:
        """Pool slots -> vLLM blocks; the bytes have landed on return."""

    def to_pool(
        self, block_ids: Sequence[int], slots: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        """Queue a save (False: refused, nothing queued); announced via `completed`."""

    def fetched(self, slots: Sequence[int], hashes: Sequence[bytes], transport: str) -> None:
        """A fetch put these blocks in the pool; announced via `completed`."""

    def completed(self) -> list[Announce]:
        """Saves and fetched blocks whose bytes are complete since the last call."""

    @property
    def in_flight(self) -> int:
        """Saves queued and not yet complete."""

    def close(self) -> None:
        """Stop using the pool mapping."""


log = logging.getLogger("kvdir.vllm")

LOAD_QUEUE_MAX = 4096
ANNOUNCE_POLL_S = 0.001
"""While saves are in flight (CUDA), how often the announcer looks for completed ones."""
ANNOUNCE_IDLE_S = 1.0
IDLE_STEP_WAIT_S = {"cuda": 0.002, "cpu": 0.02}
"""How long a step that ran no forward pass waits for a load in flight to finish,
by device. With only loading requests, vLLM's engine loop takes empty steps back
to back; each spent in Python, they starve the load thread of the GIL (and of a
core on small hosts): on 2 cores a 10 ms fetch answered the load thread after
~180 ms. Waiting here sleeps the engine thread instead; a load that ends wakes
it, so it is reported in that same step. A request arriving meanwhile is
scheduled at most this much later: 2 ms on a GPU, 20 ms on a CPU engine whose
forward passes take hundreds."""


@dataclass(frozen=True, slots=True)
class LoadJob:
    req_id: str
    hashes: tuple[bytes, ...]
    """The chain from block 0 to end_block."""
    start_block: int
    block_ids: tuple[int, ...]
    """vLLM block ids of blocks start_block..end_block-1."""
    pool_slots: tuple[int, ...]
    """This node's pool slots of the chain's leading blocks (from the lookup)."""
    ticket: bytes = b""
    """The lookup's load ticket: the peer part is fetched on it, with no second lookup."""
    inline: bool = False
    """Loaded by `load_now` on the engine's thread (a CUDA engine's same-host sources)."""
    allocated_at: float = 0.0
    """The scheduler side's time.monotonic() when vLLM allocated the blocks (0: not
    known). Same host, so comparable in the worker's process: logged with the load."""

    @property
    def end_block(self) -> int:
        return len(self.hashes)


@dataclass(slots=True)
class RemoteTrace:
    """Where one load's peer part spent its time (logged per load)."""

    blocks: int = 0
    transport: str = ""
    nbytes: int = 0
    reserve_s: float = 0.0
    fetch_s: float = 0.0
    """The Fetch call as the engine saw it (socket round trip included)."""
    agent_s: float = 0.0
    read_s: float = 0.0
    copy_s: float = 0.0
    """Pool slots -> vLLM's blocks, until the bytes landed."""


@dataclass(frozen=True, slots=True)
class SaveJob:
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class Stats:
    """Counters since the last drain (vLLM's stats path takes them per step)."""

    loaded_blocks: dict[str, int] = field(default_factory=dict)
    """By source: "pool" (this node) or the transport ("shm", "tcp", "rdma")."""
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_skipped: int = 0
    validation_misses: int = 0
    recomputed_blocks: int = 0
    retired_slots: int = 0
    """Slots never to be used again (a read into them may still land)."""
    load_seconds: list[float] = field(default_factory=list)
    peer_loads: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) of each load's peer part: what the scheduler side's cost model learns."""
    prefill_steps: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, seconds) of forward passes that computed at least a few hundred tokens."""

    def add_loaded(self, source: str, blocks: int, nbytes: int) -> None:
        self.loaded_blocks[source] = self.loaded_blocks.get(source, 0) + blocks
        self.loaded_bytes[source] = self.loaded_bytes.get(source, 0) + nbytes


def valid_local(
    before: Sequence[tuple[int, int, bytes]],
    after: Sequence[tuple[int, int, bytes]],
    hashes: Sequence[bytes],
) -> int:
    """Leading blocks whose slot header did not move during the copy and names them."""
    for i, (b, a, h) in enumerate(zip(before, after, hashes, strict=True)):
        if b != a or a[1] != STORED or a[2] != h:
            return i
    return len(hashes)


class WorkerSide:
    def __init__(
        self,
        seam: AgentSeam,
        copier: Mover,
        reserve_slots: int,
        save: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.seam = seam
        self.copier = copier
        self.block_bytes = copier.shape.block_bytes
        self.reserve_target = reserve_slots
        self.save_enabled = save
        self.clock = clock
        self.idle_wait_s = IDLE_STEP_WAIT_S.get(copier.shape.device, IDLE_STEP_WAIT_S["cuda"])
        """How long an idle step waits for a load in flight (IDLE_STEP_WAIT_S)."""
        self.engine_stream = 0
        """The engine's CUDA stream (raw handle): loads start after its queued work."""
        self.stats = Stats()
        self._stats_lock = threading.Lock()
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue(LOAD_QUEUE_MAX)
        self._in_flight = 0
        """Loads started (on the load thread or inline) and not yet taken from `_done`."""
        self._done: queue.Queue[tuple[str, list[int]]] = queue.Queue()
        self._errors: set[int] = set()
        self._stash: list[int] = []
        self._stash_lock = threading.Lock()
        self._refill = threading.Event()
        self._stop = threading.Event()
        self._queued = threading.Event()
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvdir-load", daemon=True),
            threading.Thread(target=self._refill_loop, name="kvdir-reserve", daemon=True),
            threading.Thread(target=self._announce_loop, name="kvdir-announce", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._refill.set()

    # -------------------------------------------------------------- loads

    def submit(self, job: LoadJob) -> None:
        """Queue a load (never blocks: a full queue fails the job, vLLM recomputes)."""
        self._in_flight += 1
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self._done.put((job.req_id, list(job.block_ids)))

    def load_now(self, job: LoadJob) -> None:
        """Load on the calling thread (the engine's, as a step starts): the bytes
        landed and were validated on return, and this step's `finished` reports
        the request with its failed blocks (vLLM recomputes them), so it runs in
        the next step with no wait on the load thread."""
        self._in_flight += 1
        self._run(job)

    def _run(self, job: LoadJob) -> None:
        try:
            bad = self._load(job)
        except Exception:  # a bug here must cost a recompute, never the engine
            log.exception("kvdir load failed; vLLM recomputes", extra={"req": job.req_id})
            bad = list(job.block_ids)
        with self._stats_lock:
            self.stats.recomputed_blocks += len(bad)
        self._done.put((job.req_id, bad))

    def finished(self, idle_step: bool = False) -> set[str]:
        """Requests whose loads ended since the last call; their failed blocks
        go to `take_errors` in the same step. `idle_step`: this step ran no
        forward pass, so with loads in flight and none ended it first waits up
        to `idle_wait_s` for one to end (see IDLE_STEP_WAIT_S)."""
        out: set[str] = set()
        self._announce()  # saves whose copies completed since the last step
        block = idle_step and self._in_flight > 0 and self._done.empty()
        while True:
            try:
                if block:
                    req_id, bad = self._done.get(timeout=self.idle_wait_s)
                    block = False
                else:
                    req_id, bad = self._done.get_nowait()
            except queue.Empty:
                return out
            self._in_flight -= 1
            out.add(req_id)
            self._errors.update(bad)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)
            self._announce()  # after the request may run: announcing never delays it

    def _load(self, job: LoadJob) -> list[int]:
        began = time.monotonic() - job.allocated_at if job.allocated_at else 0.0
        t0 = self.clock()
        start, end = job.start_block, job.end_block
        local = self._load_local(job)
        got = start + local
        trace = RemoteTrace()
        if got < end:
            trace = self._load_remote(job, got)
            got += trace.blocks
        took = self.clock() - t0
        with self._stats_lock:
            self.stats.load_seconds.append(took)
        log.info(
            "kvdir load: request %s, blocks %d..%d: %d from this node's pool, %d from peers "
            "over %s (%d B), %d recomputed, %.2f ms (reserve %.2f, fetch %.2f of which agent "
            "%.2f and read %.2f, copy %.2f), begun %.2f ms after allocation%s",
            job.req_id, start, end, local, trace.blocks, trace.transport or "-", trace.nbytes,
            end - got, took * 1e3, trace.reserve_s * 1e3, trace.fetch_s * 1e3,
            trace.agent_s * 1e3, trace.read_s * 1e3, trace.copy_s * 1e3, began * 1e3,
            " (inline)" if job.inline else "",
        )  # fmt: skip
        return list(job.block_ids[got - start :])

    def _headers(self, slots: Sequence[int]) -> list[tuple[int, int, bytes]]:
        pool = self.seam.pool
        out = []
        for s in slots:
            h = read_header(pool.view, pool.header_offset(s))
            out.append((h.generation, h.state, h.block_hash))
        return out

    def _load_local(self, job: LoadJob) -> int:
        start = job.start_block
        slots = list(job.pool_slots[start : job.end_block])
        if not slots:
            return 0
        before = self._headers(slots)
        self.copier.from_pool(slots, job.block_ids[: len(slots)], self.engine_stream)
        n = valid_local(before, self._headers(slots), job.hashes[start : start + len(slots)])
        with self._stats_lock:
            self.stats.add_loaded("pool", n, n * self.block_bytes)
            if n < len(slots):
                self.stats.validation_misses += 1
        return n

    def _load_remote(self, job: LoadJob, got: int) -> RemoteTrace:
        trace = RemoteTrace()
        t0 = self.clock()
        try:
            slots = self._load_slots(job.end_block - got)
        except AgentUnavailable:
            return trace
        t1 = self.clock()
        trace.reserve_s = t1 - t0
        if not slots:
            return trace
        try:
            r = self.seam.fetch(job.hashes[: got + len(slots)], got, slots, job.ticket)
        except AgentUnavailable:
            # No answer: a read into these slots may still be running in the agent, so
            # they are never written again (kept reserved until this engine exits).
            self._retire(slots)
            return trace
        t2 = self.clock()
        v = r.valid_blocks
        first = got - job.start_block
        self.copier.from_pool(slots[:v], job.block_ids[first : first + v], self.engine_stream)
        trace.copy_s = self.clock() - t2
        trace.fetch_s, trace.agent_s, trace.read_s = t2 - t1, r.seconds, r.read_seconds
        trace.blocks, trace.transport, trace.nbytes = v, r.transport, r.bytes
        if v:  # the fetched blocks stay in the pool, announced once their bytes are complete
            self.copier.fetched(slots[:v], job.hashes[got : got + v], r.transport)
            self._queued.set()
        if r.slots_retired:
            self._retire(slots[v:])
        else:
            self._give_back(slots[v:])
        with self._stats_lock:
            self.stats.add_loaded(r.transport or "none", v, r.bytes)
            if v:
                self.stats.peer_loads.append((r.bytes, self.clock() - t0))
            if r.invalidated:
                self.stats.validation_misses += 1
        return trace

    def _load_slots(self, count: int) -> list[int]:
        """Slots to fetch into: the save reserve's when it has enough (no round trip
        to the agent on the load's critical path; the refill thread tops it up),
        else newly reserved ones."""
        slots = self._take_reserved(count, whole=True)
        return slots if slots else self.seam.reserve(count)

    def _take_reserved(self, count: int, whole: bool) -> list[int]:
        """Up to `count` reserved slots (`whole`: all of them or none); the refill
        thread is woken once the reserve runs below half."""
        with self._stash_lock:
            n = count if len(self._stash) >= count or not whole else 0
            n = min(n, len(self._stash))
            slots, self._stash = self._stash[:n], self._stash[n:]
            low = len(self._stash) < self.reserve_target // 2
        if low:
            self._refill.set()
        return slots

    # -------------------------------------------------------------- saves

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Copy this step's completed blocks into reserved slots, announce them."""
        if not self.save_enabled or not jobs:
            return
        hashes = [h for j in jobs for h in j.hashes]
        blocks = [b for j in jobs for b in j.block_ids]
        slots = self._take_reserved(len(blocks), whole=False)
        n = len(slots)
        with self._stats_lock:
            self.stats.save_skipped += len(blocks) - n
        if n == 0:
            self._announce()
            return
        if not self.copier.to_pool(blocks[:n], slots, hashes[:n]):
            self._give_back(slots)
            with self._stats_lock:
                self.stats.save_skipped += n
            return
        with self._stats_lock:
            self.stats.saved_blocks += n
            self.stats.saved_bytes += n * self.block_bytes
        self._queued.set()
        self._announce()

    def _announce_loop(self) -> None:
        """Announce saves that complete after their step: an engine with no more
        work takes no more steps, and its last saves must still be published."""
        while not self._stop.is_set():
            self._queued.wait(ANNOUNCE_IDLE_S)
            self._queued.clear()
            try:
                while self.copier.in_flight and not self._stop.is_set():
                    self._stop.wait(ANNOUNCE_POLL_S)
                    self._announce()
                self._announce()
            except Exception:  # announcing is best effort; this thread must outlive a bug
                log.exception("kvdir: announcing stored blocks failed")

    def _announce(self) -> None:
        """Announce stored every save and fetched block whose bytes are complete."""
        for hashes, slots in self.copier.completed():
            try:
                self.seam.stored(hashes, slots)
            except AgentUnavailable:
                self._give_back(slots)

    def _retire(self, slots: Sequence[int]) -> None:
        """Slots a copy may still land in: never handed out again by this engine (they
        stay reserved in its name; the agent reclaims them when the engine exits)."""
        with self._stats_lock:
            self.stats.retired_slots += len(slots)
        log.warning("kvdir: %d pool slots retired: a read into them may still land", len(slots))

    def _give_back(self, slots: Sequence[int]) -> None:
        with self._stash_lock:
            self._stash.extend(slots)

    def _refill_loop(self) -> None:
        while not self._stop.is_set():
            self._refill.wait(1.0)
            self._refill.clear()
            if self._stop.is_set() or not self.save_enabled:
                return
            with self._stash_lock:
                missing = self.reserve_target - len(self._stash)
            if missing <= 0 or not self.seam.available():
                continue
            try:
                got = self.seam.reserve(missing)
            except AgentUnavailable:
                continue
            except Exception:  # this thread keeps saves possible: it must outlive any bug
                log.exception("kvdir: reserving save slots failed; retrying later")
                continue
            self._give_back(got)

    def add_prefill_step(self, tokens: int, seconds: float) -> None:
        with self._stats_lock:
            self.stats.prefill_steps.append((tokens, seconds))

    def drain_stats(self) -> Stats:
        with self._stats_lock:
            out, self.stats = self.stats, Stats()
        return out

    def close(self) -> None:
        self._stop.set()
        self._refill.set()
        self._queued.set()
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        for t in self._threads:
            t.join(2.0)
        while True:  # loads never started fail: vLLM recomputes them (never waits on them)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._done.put((job.req_id, list(job.block_ids)))
        self._announce()
        self.copier.close()
        with self._stash_lock:
            stash, self._stash = self._stash, []
        with contextlib.suppress(AgentUnavailable):
            self.seam.release(stash)
        self.seam.close()
