"""The connector's worker side across an agent restart with another pool shape.

Real agents (the trio's "a" holds the chains; this test's own agent serves
the worker), a real AgentSeam and WorkerSide. vLLM's KV cache cannot run in
this environment (no torch here): a byte mover over the seam's real pool
mapping stands in for it (`ByteMover`, blocks kept in a dict); the real vLLM
tier (tests/vllm) drives the real copiers. What is checked: a load in flight
across the change is reported failed in full (vLLM recomputes it); nothing of
the old epoch (slots, saves, reservations) reaches the new pool file; a new
seam and worker side load the same chain from the new pool, byte for byte.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.namespace import KvShape
from kvdir.agent.engine.vllm.seam import AgentSeam
from kvdir.agent.engine.vllm.worker import Announce, LoadJob, SaveJob, WorkerSide
from kvdir.agent.pool import FREE, KvPool
from kvdir.local import LocalAgent, LocalCluster, wait_for
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    BLOCK_TOKENS,
    MODEL,
    NS,
    POOL_SPEC,
    SLOT_BYTES,
    WAIT_S,
    chain_of,
    launch_all,
    stop_all,
    store_chain,
    wait_seen,
)
from tests.agent.test_pool_epochs import headers_view

pytestmark = pytest.mark.integration

SMALLER_SPEC = f"model={MODEL},block_tokens={BLOCK_TOKENS},slot_bytes={SLOT_BYTES},slots=16"
"""Another shape whose file is smaller (the old mapping reaching past it would fault);
slots as big as the holder's, so peers' blocks still fit."""
SHAPE = KvShape(layers=1, block_shape=(SLOT_BYTES,), dtype="uint8", itemsize=1, device="cpu")


class ByteMover:
    """vLLM's blocks as bytes in a dict; moves them through one pool mapping."""

    def __init__(self, pool: KvPool) -> None:
        self.shape = SHAPE
        self.pool = pool
        self.blocks: dict[int, bytes] = {}
        self._ready: list[Announce] = []

    def from_pool(self, slots: Sequence[int], block_ids: Sequence[int], stream: int = 0) -> None:
        for s, b in zip(slots, block_ids, strict=True):
            self.blocks[b] = bytes(self.pool.slot_view(s)[:SLOT_BYTES])

    def to_pool(
        self, block_ids: Sequence[int], slots: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        for b, s in zip(block_ids, slots, strict=True):
            self.pool.slot_view(s)[:SLOT_BYTES] = self.blocks[b]
        self._ready.append((tuple(hashes), tuple(slots)))
        return True

    def fetched(self, slots: Sequence[int], hashes: Sequence[bytes], transport: str) -> None:
        self._ready.append((tuple(hashes), tuple(slots)))

    def completed(self) -> list[Announce]:
        out, self._ready = self._ready, []
        return out

    @property
    def in_flight(self) -> int:
        return 0

    def close(self) -> None:
        return


@pytest.fixture
def solo(agent_cluster: LocalCluster, tmp_path: Path) -> Iterator[LocalAgent]:
    agent = LocalAgent("epoch-worker", str(tmp_path), agent_cluster.grpc_addresses, POOL_SPEC)
    try:
        launch_all([agent])
        yield agent
    finally:
        stop_all([agent])


def _worker(agent: LocalAgent) -> tuple[WorkerSide, ByteMover]:
    """What the connector builds: a seam, a mover on its mapping, a worker side."""
    seam = AgentSeam(ConnectorConfig(agent_socket=agent.engine_socket), NS, SLOT_BYTES)
    mover = ByteMover(seam.pool)
    return WorkerSide(seam, mover, reserve_slots=4, save=True), mover


def _finish(worker: WorkerSide, req_id: str) -> set[int]:
    """Wait until the load of `req_id` ended; its failed vLLM blocks."""
    done: set[str] = set()
    errors: set[int] = set()

    def ended() -> bool:
        done.update(worker.finished())
        errors.update(worker.take_errors())
        return req_id in done

    wait_for(ended, WAIT_S, f"load {req_id} to end", 0.02)
    return errors


def _job(req_id: str, chain: list[bytes], first_block_id: int) -> LoadJob:
    ids = tuple(range(first_block_id, first_block_id + len(chain)))
    return LoadJob(req_id, tuple(chain), 0, ids, ())


@pytest.mark.timeout(180)
def test_a_load_across_a_pool_change_fails_and_a_new_worker_loads_from_the_new_file(
    trio: Trio, solo: LocalAgent
) -> None:
    before, after = chain_of(2811, 4), chain_of(2812, 4)
    held: dict[int, list[bytes]] = {}
    for chain, seed in ((before, 2811), (after, 2812)):
        held[seed] = store_chain(trio.a, chain, seed=seed)[1]
    probe = EngineClient(solo.engine_socket)
    try:
        for chain in (before, after):
            wait_seen(probe, chain, "a", 4)
    finally:
        probe.close()

    worker, mover = _worker(solo)
    try:
        # Before the change: a peer load lands byte for byte.
        worker.submit(_job("r1", before, 0))
        assert _finish(worker, "r1") == set()
        assert [mover.blocks[b] for b in range(4)] == held[2811]

        solo.kill(signal.SIGKILL)
        solo.pool = SMALLER_SPEC
        solo.launch()
        worker.submit(_job("r2", after, 100))
        assert _finish(worker, "r2") == set(range(100, 104))  # all recomputed
        assert worker.seam.stale
        # Saves and reservations after the change: none reaches the new file.
        mover.blocks.update({200 + i: bytes([i]) * SLOT_BYTES for i in range(2)})
        worker.save([SaveJob(tuple(chain_of(2813, 2)), (200, 201))])
        worker.finished()  # announces what completed
        new_file = headers_view(solo)
        try:
            hdrs = [new_file.header(s) for s in range(new_file.geometry.slots)]
            assert all((h.state, h.generation) == (FREE, 0) for h in hdrs)
        finally:
            new_file.close()
    finally:
        worker.close()

    fresh, fresh_mover = _worker(solo)
    try:
        probe = EngineClient(solo.engine_socket)
        try:
            wait_seen(probe, after, "a", 4)  # the restarted agent's view of the directory
        finally:
            probe.close()
        fresh.submit(_job("r3", after, 300))
        assert _finish(fresh, "r3") == set()
        assert [fresh_mover.blocks[b] for b in range(300, 304)] == held[2812]
        assert fresh_mover.pool.geometry.slots == 16
    finally:
        fresh.close()
