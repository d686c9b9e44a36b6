"""An eviction racing a fetch, made deterministic with the fetcher's `after_data` hook.

The reader is an `AgentDaemon` running in this process (it serves a real
Unix socket and a real TCP port, registers with the real directory); the
holder is trio agent "a", a real `kvdir agent serve` process. The hook runs
between the reader's data read and its header read, and makes the holder's
engine evict block j and overwrite that slot (through its own EngineClient,
as an engine would). The fetch must then claim exactly blocks 0..j-1, each
byte-identical to what the holder stored.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdir.agent.config import AgentConfig, PoolConfig
from kvdir.agent.daemon import AgentDaemon
from kvdir.agent.engine.client import EngineClient
from kvdir.agent.pool import STORED
from kvdir.core.client import DirectoryClient, records
from kvdir.core.wire import namespace_key
from kvdir.local import LOOPBACK, LocalCluster, free_ports, wait_for
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    BLOCK_TOKENS,
    MODEL,
    NS,
    SLOT_BYTES,
    SLOTS,
    WAIT_S,
    chain_of,
    slot_bytes,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration

BLOCKS = 6


@dataclass
class Reader:
    transport: str
    daemon: AgentDaemon
    engine: EngineClient


@pytest.fixture(scope="module", params=["tcp", "shm"])
def reader(
    request: pytest.FixtureRequest,
    agent_cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Reader]:
    transport: str = request.param
    base: Path = tmp_path_factory.mktemp(f"inproc-{transport}")
    (port,) = free_ports(1)
    cfg = AgentConfig(
        node_id=f"inproc-{transport}",
        host=LOOPBACK,
        directory=tuple(agent_cluster.grpc_addresses),
        listen=f"{LOOPBACK}:{port}",
        engine_socket=os.path.join(base, "agent.sock"),
        pools=(PoolConfig(MODEL, BLOCK_TOKENS, SLOT_BYTES, SLOTS),),
        transports=("tcp",) if transport == "tcp" else ("tcp", "shm"),
        lease_ms=5000,
        pool_dir=str(base),
    )
    daemon = AgentDaemon(cfg)
    engine: EngineClient | None = None
    try:
        daemon.start()
        engine = EngineClient(cfg.engine_socket)
        yield Reader(transport, daemon, engine)
    finally:
        if engine is not None:
            engine.close()
        if daemon.fetcher is not None:
            daemon.fetcher.after_data = None
        daemon.stop()  # closes the peer channels it cached


def _wait_generation(
    cluster: LocalCluster,
    directory: DirectoryClient,
    chain: list[bytes],
    j: int,
    generation: int,
    reader: Reader,
) -> None:
    """Wait until every replica has node a's record of block j at `generation`,
    then until the reader's mirror (when it has one) has applied what they have."""

    def replicas_have_it() -> bool:
        for address in cluster.grpc_addresses:
            resp = directory.lookup(NS, chain, address=address)
            match = next((m for m in resp.matches if m.node_id == "a"), None)
            if match is None or match.prefix_blocks <= j:
                return False
            if records(match).generations[j] != generation:
                return False
        return True

    wait_for(replicas_have_it, WAIT_S, f"every replica to have block {j} at {generation}")
    mirror = reader.daemon.mirror
    if mirror is not None:
        need = max(directory.status(a).applied_index for a in cluster.grpc_addresses)
        wait_for(
            lambda: mirror.mirror.applied_index >= need,
            WAIT_S,
            f"the reader's mirror to apply index {need}",
        )


def _hook(reader: Reader, action: Callable[[], None]) -> list[int]:
    assert reader.daemon.fetcher is not None
    fired: list[int] = []

    def after_data() -> None:
        fired.append(1)
        action()

    reader.daemon.fetcher.after_data = after_data
    return fired


def _unhook(reader: Reader) -> None:
    assert reader.daemon.fetcher is not None
    reader.daemon.fetcher.after_data = None


@pytest.mark.timeout(120)
def test_without_a_race_every_block_is_valid(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio, reader: Reader
) -> None:
    chain = chain_of(100 + (reader.transport == "shm"), BLOCKS)
    _, payload = store_chain(trio.a, chain, seed=100)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[reader.engine])
    dst = reader.engine.allocate(NS, BLOCKS).slots
    fired = _hook(reader, lambda: None)
    try:
        r = reader.engine.fetch(NS, chain, dst)
    finally:
        _unhook(reader)
    assert fired == [1]
    assert (r.valid_blocks, r.invalidated, r.transport, r.source_node) == (
        BLOCKS,
        0,
        reader.transport,
        "a",
    )
    assert [slot_bytes(reader.engine, s) for s in dst] == payload
    reader.engine.free(NS, dst)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restore", [False, True], ids=["evict", "evict-and-restore"])
@pytest.mark.parametrize("j", [0, 2, BLOCKS - 1])
def test_an_eviction_during_the_fetch_ends_the_valid_prefix(
    agent_cluster: LocalCluster,
    directory: DirectoryClient,
    trio: Trio,
    reader: Reader,
    j: int,
    restore: bool,
) -> None:
    """`restore`: after the eviction the engine stores the same block hash into the
    same slot again with other bytes (ABA); the new generation must still fail it."""
    salt = 200 + 10 * j + 2 * restore + (reader.transport == "shm")
    chain = chain_of(salt, BLOCKS)
    slots, payload = store_chain(trio.a, chain, seed=salt)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[reader.engine])
    holder_pool = trio.a.pools[namespace_key(NS)].pool
    victim = slots[j]
    published_gen = holder_pool.header(victim).generation

    def evict_and_overwrite() -> None:
        trio.a.removed(NS, [chain[j]], [victim])  # bumps the generation before returning
        trio.a.slot_view(NS, victim)[:] = b"\xee" * SLOT_BYTES
        if restore:
            trio.a.stored(NS, [chain[j]], [victim])
            wait_for(
                lambda: holder_pool.header(victim).state == STORED,
                WAIT_S,
                "the engine library to mark the slot stored again",
            )

    dst = reader.engine.allocate(NS, BLOCKS).slots
    fired = _hook(reader, evict_and_overwrite)
    try:
        r = reader.engine.fetch(NS, chain, dst)
    finally:
        _unhook(reader)
    assert fired == [1]
    after = holder_pool.header(victim)
    assert after.generation > published_gen
    assert (after.state == STORED and after.block_hash == chain[j]) is restore
    assert (r.source_node, r.transport) == ("a", reader.transport)
    assert r.valid_blocks == j
    assert r.invalidated == BLOCKS - j
    got = [slot_bytes(reader.engine, s) for s in dst]
    assert got[:j] == payload[:j]  # every block claimed valid is the holder's block
    # The directory follows the eviction: a later fetch no longer offers block j.
    trio.a.flush()
    wait_prefix(
        agent_cluster, directory, chain, "a", BLOCKS if restore else j, readers=[reader.engine]
    )
    if restore:
        # Re-stored under a new generation: the new bytes are what a fetch now gets,
        # once the reader's directory has the new record (the prefix was BLOCKS
        # before the eviction too, so the wait above may have passed on the old).
        _wait_generation(agent_cluster, directory, chain, j, after.generation, reader)
        again = reader.engine.fetch(NS, chain, dst)
        assert (again.valid_blocks, again.invalidated) == (BLOCKS, 0)
        assert slot_bytes(reader.engine, dst[j]) == b"\xee" * SLOT_BYTES
    reader.engine.free(NS, dst)
    trio.a.free(NS, slots)
