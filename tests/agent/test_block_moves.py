"""A block that moves between slots of one node within one notification batch.

Generations are per slot, while the directory keeps one record per (node,
tier, block) and drops a publish whose generation is lower than the
record's as stale. The notifications are sent through a raw Engine stub so
that "evicted from s1" and "stored in s2" arrive in one batch, as the engine
library ships them when they are queued together.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvdir.core.client import DirectoryClient
from kvdir.core.wire import namespace_key
from kvdir.local import LocalCluster, wait_for
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    NS,
    SLOT_BYTES,
    chain_of,
    slot_bytes,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def stub(trio: Trio) -> Iterator[apb_grpc.EngineStub]:
    with grpc.insecure_channel(f"unix:{trio.agents['a'].engine_socket}") as ch:
        yield apb_grpc.EngineStub(ch)


def _churned_slot(trio: Trio, rounds: int) -> int:
    """A slot allocated and freed `rounds` more times (generation >= 2 * rounds + 1)."""
    (s,) = trio.a.allocate(NS, 1).slots
    for _ in range(rounds):
        trio.a.free(NS, [s])
        (again,) = trio.a.allocate(NS, 1).slots
        assert again == s  # the agent's free list is LIFO
    return s


@pytest.mark.timeout(120)
def test_evicted_and_restored_in_the_same_slot_stays_published(
    agent_cluster: LocalCluster,
    directory: DirectoryClient,
    trio: Trio,
    stub: apb_grpc.EngineStub,
) -> None:
    """Same slot, new generation (the ABA case): the new record replaces the old one.

    (Before the agent applied a batch's removals ahead of its stores, the removal
    of the old generation cancelled the store and the block vanished until a resync.)
    """
    chain = chain_of(700, 1)
    (s,), _ = store_chain(trio.a, chain, seed=700)
    wait_prefix(agent_cluster, directory, chain, "a", 1)
    pool = trio.a.pools[namespace_key(NS)].pool
    old = pool.header(s).generation
    new = pool.evict(s)
    trio.a.slot_view(NS, s)[:] = b"\x11" * SLOT_BYTES
    assert pool.mark_stored(s, chain[0], new)
    stub.Notify(
        apb.NotifyRequest(
            namespace=NS,
            removed_hashes=chain,
            removed_slots=[s],
            removed_generations=[old],
            stored_hashes=chain,
            stored_slots=[s],
            stored_generations=[new],
        ),
        timeout=10,
    )
    dst = trio.b.allocate(NS, 1).slots

    def fetched() -> bool:
        return trio.b.fetch(NS, chain, dst).valid_blocks == 1

    wait_for(fetched, 10, "the re-stored block to be fetchable", 0.05)
    assert slot_bytes(trio.b, dst[0]) == b"\x11" * SLOT_BYTES
    trio.b.free(NS, dst)
    trio.a.free(NS, [s])


@pytest.mark.timeout(120)
def test_a_block_moved_to_a_slot_with_a_lower_generation_stays_fetchable(
    agent_cluster: LocalCluster,
    directory: DirectoryClient,
    trio: Trio,
    stub: apb_grpc.EngineStub,
) -> None:
    chain = chain_of(710, 1)
    s1 = _churned_slot(trio, 3)
    pool = trio.a.pools[namespace_key(NS)].pool
    g1 = pool.header(s1).generation
    assert g1 >= 2 * 3 + 1  # at least; slots earlier tests used start higher
    trio.a.slot_view(NS, s1)[:] = b"\x01" * SLOT_BYTES
    trio.a.stored(NS, chain, [s1])
    trio.a.flush()
    wait_prefix(agent_cluster, directory, chain, "a", 1)

    # The engine evicts the block from s1 and stores it again in a fresh slot s2.
    (s2,) = trio.a.allocate(NS, 1).slots
    g2 = pool.header(s2).generation
    assert g2 < g1
    pool.evict(s1)
    trio.a.slot_view(NS, s2)[:] = b"\x02" * SLOT_BYTES
    assert pool.mark_stored(s2, chain[0], g2)
    stub.Notify(
        apb.NotifyRequest(
            namespace=NS,
            removed_hashes=chain,
            removed_slots=[s1],
            removed_generations=[g1],
            stored_hashes=chain,
            stored_slots=[s2],
            stored_generations=[g2],
        ),
        timeout=10,
    )
    dst = trio.b.allocate(NS, 1).slots
    try:

        def fetched() -> bool:
            return trio.b.fetch(NS, chain, dst).valid_blocks == 1

        wait_for(fetched, 5, "the moved block to be fetchable from its new slot", 0.05)
        assert slot_bytes(trio.b, dst[0]) == b"\x02" * SLOT_BYTES
    finally:
        trio.b.free(NS, dst)
        trio.a.free(NS, [s1, s2])
