"""End to end over rdma, inside the VM: a real 3-replica directory, holder agent A
(a `kvdir agent serve` process offering rdma and tcp) and reader B (an
AgentDaemon in this process offering rdma only, so nothing else can carry the
bytes). B fetches a prefix A published: the directory's rkey and address are
A's real memory registration, the data and header reads are RDMA READs, the
bytes are verified, and an eviction racing the fetch (made deterministic with
the fetcher's `after_data` hook) ends the valid prefix exactly there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvdir.agent.config import AgentConfig, PoolConfig
from kvdir.agent.daemon import AgentDaemon
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient
from kvdir.local import LOOPBACK, LocalAgent, LocalCluster, free_ports
from tests.agent.helpers import (
    BLOCK_TOKENS,
    MODEL,
    NS,
    POOL_SPEC,
    SLOT_BYTES,
    SLOTS,
    chain_of,
    slot_bytes,
    store_chain,
    wait_prefix,
)

BLOCKS = 6
SLOW_S = 180.0
"""Waits under TCG emulation: everything is 10-50x slower than on hardware."""


@dataclass
class World:
    cluster: LocalCluster
    directory: DirectoryClient
    a: EngineClient
    b: EngineClient
    reader: AgentDaemon


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base: Path = tmp_path_factory.mktemp("rdma-e2e")
    cluster = LocalCluster(str(base / "directory"), size=3)
    holder = LocalAgent(
        "a", str(base), cluster.grpc_addresses, POOL_SPEC, transports="rdma,tcp", lease_ms=60_000
    )
    (port,) = free_ports(1)
    cfg = AgentConfig(
        node_id="b",
        host=LOOPBACK,
        directory=tuple(cluster.grpc_addresses),
        listen=f"{LOOPBACK}:{port}",
        engine_socket=os.path.join(base, "b.sock"),
        pools=(PoolConfig(MODEL, BLOCK_TOKENS, SLOT_BYTES, SLOTS),),
        transports=("rdma",),
        lease_ms=60_000,
        pool_dir=str(base),
        fetch_timeout_ms=60_000,
        rdma_device=os.environ.get("KVDIR_RDMA_DEVICE", ""),
    )
    reader = AgentDaemon(cfg)
    engines: list[EngineClient] = []
    directory: DirectoryClient | None = None
    try:
        cluster.start(timeout_s=SLOW_S)
        holder.launch(timeout_s=SLOW_S)
        reader.start()
        engines = [
            EngineClient(holder.engine_socket, timeout_s=SLOW_S),
            EngineClient(cfg.engine_socket, timeout_s=SLOW_S),
        ]
        directory = cluster.client(timeout_s=30)
        yield World(cluster, directory, engines[0], engines[1], reader)
    finally:
        for e in engines:
            e.close()
        if directory is not None:
            directory.close()
        if reader.fetcher is not None:
            for peer in list(reader.fetcher.peers.peers.values()):
                peer.channel.close()
        reader.stop()
        holder.stop()
        cluster.stop()


@pytest.mark.timeout(600)
def test_b_fetches_a_prefix_from_a_over_rdma(world: World) -> None:
    chain = chain_of(1, BLOCKS)
    _, payload = store_chain(world.a, chain, seed=1)
    wait_prefix(
        world.cluster, world.directory, chain, "a", BLOCKS, timeout_s=SLOW_S, readers=[world.b]
    )
    # The directory publishes A's real memory registration (its MR's rkey).
    match = next(m for m in world.directory.lookup(NS, chain).matches if m.node_id == "a")
    assert "rdma" in match.transports
    dst = world.b.allocate(NS, BLOCKS).slots
    r = world.b.fetch(NS, chain, dst, timeout_ms=120_000)
    assert (r.valid_blocks, r.invalidated, r.transport, r.source_node) == (BLOCKS, 0, "rdma", "a")
    assert r.bytes == BLOCKS * SLOT_BYTES
    assert [slot_bytes(world.b, s) for s in dst] == payload
    world.b.free(NS, dst)
    # The agent's rdma transport counts into the agent's exported metric; a clean fetch: none.
    assert world.reader.engine is not None
    rdma = world.reader.engine.transports["rdma"]
    assert getattr(rdma, "errors", None) is world.reader.metrics.rdma_errors
    exposed = generate_latest(world.reader.metrics.registry).decode()
    assert 'kvdir_agent_rdma_errors_total{kind="completion",status=""} 0.0' in exposed
    assert sum(world.reader.metrics.rdma_errors.snapshot().values()) == 0


@pytest.mark.timeout(600)
def test_an_eviction_racing_the_fetch_is_detected(world: World) -> None:
    j = 2
    chain = chain_of(2, BLOCKS)
    slots, payload = store_chain(world.a, chain, seed=2)
    wait_prefix(
        world.cluster, world.directory, chain, "a", BLOCKS, timeout_s=SLOW_S, readers=[world.b]
    )
    victim = slots[j]
    fired: list[int] = []

    def evict_and_overwrite() -> None:
        fired.append(1)
        world.a.removed(NS, [chain[j]], [victim])  # bumps the generation before returning
        world.a.slot_view(NS, victim)[:] = b"\xee" * SLOT_BYTES

    assert world.reader.fetcher is not None
    world.reader.fetcher.after_data = evict_and_overwrite
    dst = world.b.allocate(NS, BLOCKS).slots
    try:
        r = world.b.fetch(NS, chain, dst, timeout_ms=120_000)
    finally:
        world.reader.fetcher.after_data = None
    assert fired == [1]
    assert (r.transport, r.valid_blocks, r.invalidated) == ("rdma", j, BLOCKS - j)
    assert [slot_bytes(world.b, s) for s in dst[:j]] == payload[:j]
    world.b.free(NS, dst)
