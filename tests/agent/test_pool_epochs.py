"""Pool epochs and dead engines' slots, against a real `kvdir agent serve` process.

An agent restarted under a running engine, with the same or another pool
shape: the engine keeps reading its old mapping without a fault, never reaches
the new pool through it, and its requests naming old slots are refused; the
connector's seam attaches again (or, holding a copier's mapping, goes stale
and loads fail until its owner re-attaches). An engine process killed while
it holds reserved slots: the agent gives them back, generations bumped, also
across an agent restart. Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.agent.engine.client import EngineClient, EngineError, PoolChanged
from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.seam import AgentSeam, AgentUnavailable
from kvdir.agent.pool import ALLOCATED, FREE, Geometry, KvPool
from kvdir.agent.pool_file import read_superblock
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.transfer.memory import SharedMemory
from tests.agent.helpers import (
    BLOCK_TOKENS,
    MODEL,
    NS,
    POOL_SPEC,
    SLOT_BYTES,
    SLOTS,
    WAIT_S,
    chain_of,
    launch_all,
    slot_bytes,
    stop_all,
    store_chain,
)

pytestmark = pytest.mark.integration

REPO_ROOT = str(Path(__file__).resolve().parents[2])
BIGGER_SPEC = f"model={MODEL},block_tokens={BLOCK_TOKENS},slot_bytes={SLOT_BYTES * 2},slots=8"
"""Another shape: a file smaller than the old one (8 x 128 KiB < 128 x 64 KiB)."""


@pytest.fixture
def solo(
    request: pytest.FixtureRequest, agent_cluster: LocalCluster, tmp_path: Path
) -> Iterator[LocalAgent]:
    node_id = "epoch-" + request.node.name.removeprefix("test_")[:24]
    agent = LocalAgent(node_id, str(tmp_path), agent_cluster.grpc_addresses, POOL_SPEC)
    try:
        launch_all([agent])
        yield agent
    finally:
        stop_all([agent])


def restart(agent: LocalAgent, pool: str) -> None:
    """SIGKILL (no goodbye, as a crash) and start again with `pool`."""
    agent.kill(signal.SIGKILL)
    agent.pool = pool
    agent.launch()


def pool_file(agent: LocalAgent) -> str:
    return os.path.join(agent.pool_dir, f"kvdir-{agent.node_id}-pool0")


def headers_view(agent: LocalAgent) -> KvPool:
    """The pool file as it is now, mapped like an engine maps it (to read headers)."""
    mem = SharedMemory.open_readwrite(pool_file(agent), owner=False)
    sb = read_superblock(mem.mm)
    assert sb is not None
    return KvPool(mem, Geometry.of(sb.slot_bytes, sb.slots), "")


@pytest.mark.timeout(120)
def test_a_restart_with_the_same_shape_keeps_the_epoch_and_the_mapping(solo: LocalAgent) -> None:
    engine = EngineClient(solo.engine_socket)
    try:
        chain = chain_of(2801, 4)
        slots, payload = store_chain(engine, chain, seed=2801)
        spare = engine.allocate(NS, 2).slots
        epoch = engine.pools[next(iter(engine.pools))].epoch
        restart(solo, POOL_SPEC)
        # Same file, same epoch: the old client and its reserved slots stay good.
        assert engine.current(NS)
        wait_for(lambda: engine.lookup(NS, chain).local_blocks == 4, WAIT_S, "the re-index")
        assert list(engine.lookup(NS, chain).local_slots) == slots
        assert [slot_bytes(engine, s) for s in slots] == payload
        assert engine.free(NS, spare) == 2
        again = EngineClient(solo.engine_socket)
        try:
            assert next(iter(again.pools.values())).epoch == epoch
        finally:
            again.close()
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_restart_with_another_shape_refuses_the_old_epoch_and_never_faults(
    solo: LocalAgent,
) -> None:
    old = EngineClient(solo.engine_socket)
    try:
        chain = chain_of(2802, 3)
        slots, payload = store_chain(old, chain, seed=2802)
        held = old.allocate(NS, 4).slots
        last = SLOTS - 1
        restart(solo, BIGGER_SPEC)
        assert not old.current(NS)
        # The old mapping is whole (its file was replaced, not truncated: reading
        # its last slot would SIGBUS otherwise) and still holds what was written.
        assert [slot_bytes(old, s) for s in slots] == payload
        assert len(slot_bytes(old, last)) == SLOT_BYTES
        # A new engine gets the new epoch and shape; it owns some slots.
        new = EngineClient(solo.engine_socket)
        try:
            info = next(iter(new.pools.values())).info
            assert (info.slot_bytes, info.slots) == (SLOT_BYTES * 2, 8)
            assert info.epoch != old.pools[next(iter(old.pools))].epoch
            mine = new.allocate(NS, 8).slots
            pool = new.pools[next(iter(new.pools))].pool
            gens = [pool.header(s) for s in mine]
            # Every request naming old-epoch slots is refused: none reaches the new pool.
            with pytest.raises(PoolChanged):
                old.free(NS, held)
            with pytest.raises(PoolChanged):
                old.fetch(NS, chain, held)
            with pytest.raises(PoolChanged):
                old.allocate(NS, 1)
            with pytest.raises(PoolChanged):
                old.lookup(NS, chain)
            assert [pool.header(s) for s in mine] == gens
            assert all(h.state == ALLOCATED for h in gens)
            # Headers the old client writes land in the old file only.
            old.stored(NS, chain[:1], held[:1])
            old.flush()
            assert [pool.header(s) for s in mine] == gens
        finally:
            new.close()
    finally:
        old.close()


def _seam(agent: LocalAgent) -> AgentSeam:
    cfg = ConnectorConfig(agent_socket=agent.engine_socket, agent_retry_s=60.0)
    return AgentSeam(cfg, NS, SLOT_BYTES)


@pytest.mark.timeout(120)
def test_the_scheduler_seam_attaches_again_after_a_new_epoch(solo: LocalAgent) -> None:
    seam = _seam(solo)
    try:
        chain = chain_of(2803, 2)
        assert seam.lookup(chain).answered
        before = seam.epoch
        restart(solo, BIGGER_SPEC)
        with pytest.raises(AgentUnavailable):
            seam.lookup(chain)  # the answer was for another epoch: not used
        # No back-off: the next call attaches to the new epoch.
        assert seam.available()
        assert seam.lookup(chain).answered
        assert seam.epoch not in (0, before)
    finally:
        seam.close()


@pytest.mark.timeout(120)
def test_a_worker_seam_goes_stale_for_good_and_a_new_seam_maps_the_new_epoch(
    solo: LocalAgent,
) -> None:
    """A load in flight across the change fails (vLLM recomputes); the copier's
    mapping is never swapped under it, and its slots never reach the new pool;
    a new seam (what the connector builds with a new copier) maps the new epoch."""
    seam = _seam(solo)
    try:
        mapped = seam.pool  # what a copier holds
        old_epoch = seam.epoch
        slots = seam.reserve(3)
        chain = chain_of(2804, 3)
        restart(solo, BIGGER_SPEC)
        with pytest.raises(AgentUnavailable):
            seam.fetch(chain, 0, slots)
        assert seam.stale and not seam.available()
        assert seam.pool is mapped and mapped.epoch == old_epoch and mapped.retired
        for verb in (lambda: seam.reserve(1), lambda: seam.lookup(chain)):
            with pytest.raises(AgentUnavailable):
                verb()
        seam.release(slots)  # old slots: dropped, never sent to the new pool
        with pytest.raises(AgentUnavailable):
            seam.stored(chain, slots)
        seam.close()
        with pytest.raises(AgentUnavailable):
            seam.pool  # noqa: B018 (closed for good: no mapping of another epoch appears)
        assert seam.stale
    finally:
        seam.close()
    again = _seam(solo)
    try:
        fresh = again.pool
        assert fresh.geometry.slot_bytes == SLOT_BYTES * 2
        assert again.epoch not in (0, old_epoch) and len(again.reserve(2)) == 2
    finally:
        again.close()


# -------------------------------------------------------------- dead engines

_HOLDER = """
import json, sys
from kvdir.agent.engine.client import EngineClient
from tests.agent.helpers import NS
e = EngineClient(sys.argv[1])
a = e.allocate(NS, int(sys.argv[2]), evict=True)
print(json.dumps([a.slots, a.generations]), flush=True)
sys.stdin.read()  # hold them until killed
"""


def _holder(agent: LocalAgent, count: int) -> tuple[subprocess.Popen[str], list[int], list[int]]:
    """A real engine process that reserved `count` slots and keeps them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, agent.engine_socket, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,  # the holder imports tests.agent.helpers
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _kill(proc)
        raise AssertionError("the holder process died before reserving")
    slots, gens = json.loads(line)
    return proc, slots, gens


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(30)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _reclaimed(view: KvPool, slots: list[int], gens: list[int]) -> bool:
    return all(
        view.header(s).state == FREE and view.header(s).generation > g
        for s, g in zip(slots, gens, strict=True)
    )


@pytest.mark.timeout(120)
def test_a_dead_engines_reserved_slots_come_back_with_new_generations(
    solo: LocalAgent,
) -> None:
    live = EngineClient(solo.engine_socket)
    proc, slots, gens = _holder(solo, 10)
    view = headers_view(solo)
    try:
        mine = live.allocate(NS, 5)
        assert all(view.header(s).state == ALLOCATED for s in slots)
        assert view.owner(slots[0]).pid == proc.pid
        _kill(proc)
        wait_for(lambda: _reclaimed(view, slots, gens), WAIT_S, "the dead engine's slots", 0.05)
        # The live engine's reservation was looked at in the same pass and kept.
        assert all(view.header(s).state == ALLOCATED for s in mine.slots)
        assert [view.header(s).generation for s in mine.slots] == mine.generations
        # The slots are handed out again (the pool has its 128 free minus ours).
        assert len(live.allocate(NS, SLOTS - 5).slots) == SLOTS - 5
    finally:
        _kill(proc)
        view.close()
        live.close()


@pytest.mark.timeout(120)
def test_slots_of_an_engine_that_died_while_the_agent_was_down_come_back(
    solo: LocalAgent,
) -> None:
    """The owner is in the slot headers: a restarted agent reclaims them too."""
    proc, slots, gens = _holder(solo, 6)
    try:
        solo.kill(signal.SIGKILL)
        _kill(proc)
        solo.launch()
        view = headers_view(solo)
        try:
            wait_for(lambda: _reclaimed(view, slots, gens), WAIT_S, "the slots after restart", 0.05)
        finally:
            view.close()
    finally:
        _kill(proc)


@pytest.mark.timeout(120)
def test_a_fetch_into_slots_the_caller_does_not_hold_is_refused(solo: LocalAgent) -> None:
    """Another engine's reservation, or a free slot (a dead engine's, reclaimed):
    a fetch must not write there (a late fetch of a dead engine would otherwise
    land in slots handed to someone else)."""
    engine = EngineClient(solo.engine_socket)
    proc, theirs, _ = _holder(solo, 3)
    try:
        chain = chain_of(2805, 3)
        mine = engine.allocate(NS, 3).slots
        free = sorted(set(range(SLOTS)) - set(mine) - set(theirs))[:3]
        for slots in (theirs, free, [mine[0], theirs[0], mine[1]]):
            with pytest.raises(EngineError, match="does not hold"):
                engine.fetch(NS, chain, slots)
        assert engine.fetch(NS, chain, mine).valid_blocks == 0  # held: served (a miss)
    finally:
        _kill(proc)
        engine.close()
