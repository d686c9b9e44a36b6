"""Fetching real KV bytes between agent processes over tcp and over shm."""

from __future__ import annotations

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster
from tests.agent.conftest import Trio
from tests.agent.helpers import NS, SLOT_BYTES, chain_of, slot_bytes, store_chain, wait_prefix

pytestmark = pytest.mark.integration

READERS = [("b", "tcp"), ("c", "shm")]


@pytest.mark.timeout(120)
def test_peers_fetch_byte_identical_blocks_over_tcp_and_shm(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(1, 12)
    slots, payload = store_chain(trio.a, chain, seed=1)
    wait_prefix(agent_cluster, directory, chain, "a", 12, readers=[trio.b, trio.c])

    local = trio.a.lookup(NS, chain)
    assert (local.local_blocks, list(local.local_slots)) == (12, slots)

    for reader, transport in READERS:
        engine = trio.engines[reader]
        seen = engine.lookup(NS, chain)
        assert seen.local_blocks == 0
        assert {p.node_id: p.prefix_blocks for p in seen.peers} == {"a": 12}
        dst = engine.allocate(NS, 12).slots
        r = engine.fetch(NS, chain, dst)
        assert (r.valid_blocks, r.invalidated) == (12, 0), reader
        assert (r.source_node, r.transport) == ("a", transport)
        assert r.bytes == 12 * SLOT_BYTES
        assert [slot_bytes(engine, s) for s in dst] == payload, f"{reader} got other bytes"
        engine.free(NS, dst)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [1, 5])
def test_a_holder_of_a_partial_prefix_gives_exactly_that_prefix(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio, k: int
) -> None:
    chain = chain_of(10 + k, 8)
    _, payload = store_chain(trio.a, chain[:k], seed=2)
    wait_prefix(agent_cluster, directory, chain, "a", k, readers=[trio.b, trio.c])
    for reader, transport in READERS:
        engine = trio.engines[reader]
        dst = engine.allocate(NS, len(chain)).slots
        r = engine.fetch(NS, chain, dst)
        assert (r.valid_blocks, r.invalidated, r.transport) == (k, 0, transport), reader
        assert r.bytes == k * SLOT_BYTES
        assert [slot_bytes(engine, s) for s in dst[:k]] == payload
        engine.free(NS, dst)


@pytest.mark.timeout(120)
def test_the_longest_holder_wins_and_a_miss_is_empty(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(20, 6)
    _, short = store_chain(trio.a, chain[:2], seed=3)
    _, full = store_chain(trio.c, chain, seed=4)
    wait_prefix(agent_cluster, directory, chain, "a", 2, readers=[trio.b])
    wait_prefix(agent_cluster, directory, chain, "c", 6, readers=[trio.b])
    dst = trio.b.allocate(NS, 6).slots
    r = trio.b.fetch(NS, chain, dst)
    assert (r.valid_blocks, r.source_node, r.transport) == (6, "c", "tcp")
    assert [slot_bytes(trio.b, s) for s in dst] == full
    assert short != full[:2]  # so the check above tells the holders apart

    miss = chain_of(21, 3)
    r = trio.b.fetch(NS, miss, dst[:3])
    assert (r.valid_blocks, r.bytes, r.source_node) == (0, 0, "")
    trio.b.free(NS, dst)


@pytest.mark.timeout(120)
def test_removed_and_freed_blocks_leave_the_directory(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(30, 4)
    slots, _ = store_chain(trio.a, chain, seed=5)
    wait_prefix(agent_cluster, directory, chain, "a", 4)
    trio.a.removed(NS, [chain[2]], [slots[2]])  # evicted: the prefix ends at block 2
    trio.a.flush()
    wait_prefix(agent_cluster, directory, chain, "a", 2)
    trio.a.free(NS, slots[:2])  # freed: nothing of the chain is left
    wait_prefix(agent_cluster, directory, chain, "a", 0, readers=[trio.c])
    dst = trio.c.allocate(NS, 4).slots
    assert trio.c.fetch(NS, chain, dst).valid_blocks == 0
    trio.c.free(NS, dst)
    trio.a.free(NS, slots[2:])
