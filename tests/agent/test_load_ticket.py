"""One lookup, one fetch: the engine's Lookup answers with a load ticket, and its Fetch
on that ticket reads the holders it names without asking the directory again.

Real agents (the trio: `kvdir agent serve` processes) and a real 3-replica
directory. The reader is trio agent c (tcp+shm, mirror on); "directory
lookups" are its own count (`kvdir_agent_mirror_lookups`, both sources).
"""

from __future__ import annotations

import pytest

from kvdir.agent.engine.client import EngineError, Refused
from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.seam import AgentSeam
from kvdir.agent.pool import STORED
from kvdir.core.client import DirectoryClient
from kvdir.core.wire import namespace_key
from kvdir.local import LocalCluster, wait_for
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    FALLBACK,
    NS,
    SERVED,
    SLOT_BYTES,
    WAIT_S,
    chain_of,
    scrape,
    slot_bytes,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration

BLOCKS = 6


def _lookups(trio: Trio) -> float:
    page = scrape(trio.agents["c"].metrics_address)
    return page.get(SERVED, 0.0) + page.get(FALLBACK, 0.0)


@pytest.mark.timeout(120)
def test_a_fetch_on_the_ticket_reads_without_a_second_lookup(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(900, BLOCKS)
    _, payload = store_chain(trio.a, chain, seed=900)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    before = _lookups(trio)
    found = trio.c.lookup(NS, chain)
    assert found.ticket and found.local_blocks == 0
    # "host" until this agent opened a channel to a (other tests may have): then its transport
    assert found.fetch_path in ("host", "shm")
    dst = trio.c.allocate(NS, BLOCKS).slots
    r = trio.c.fetch(NS, chain, dst, ticket=found.ticket)
    assert (r.valid_blocks, r.invalidated, r.source_node) == (BLOCKS, 0, "a")
    assert [slot_bytes(trio.c, s) for s in dst] == payload
    assert _lookups(trio) == before + 1  # the Lookup's; the fetch asked nobody
    # Without a ticket the old path still works, and looks the chain up itself.
    again = trio.c.allocate(NS, BLOCKS).slots
    r = trio.c.fetch(NS, chain, again)
    assert r.valid_blocks == BLOCKS
    assert _lookups(trio) == before + 2
    # With a channel to a open, the Lookup names its transport (the engine inlines shm).
    assert trio.c.lookup(NS, chain).fetch_path == r.transport != ""
    trio.c.free(NS, dst + again)


@pytest.mark.timeout(120)
def test_a_damaged_ticket_is_refused_and_the_agent_goes_on(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(901, BLOCKS)
    store_chain(trio.a, chain, seed=901)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    ticket = bytearray(trio.c.lookup(NS, chain).ticket)
    ticket[-1] ^= 0xFF
    dst = trio.c.allocate(NS, BLOCKS).slots
    with pytest.raises(Refused, match="not issued by this agent"):
        trio.c.fetch(NS, chain, dst, ticket=bytes(ticket))
    with pytest.raises(EngineError, match="over"):
        trio.c.fetch(NS, chain, dst, ticket=b"\0" * (1 << 20))
    r = trio.c.fetch(NS, chain, dst, ticket=trio.c.lookup(NS, chain).ticket)
    assert r.valid_blocks == BLOCKS
    trio.c.free(NS, dst)


@pytest.mark.timeout(120)
def test_a_slot_reused_after_the_lookup_ends_the_valid_prefix(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    """The ticket names generation g of block j; the holder evicts it and stores the
    same hash again with other bytes (generation g+1) before the fetch reads."""
    j = 3
    chain = chain_of(902, BLOCKS)
    slots, payload = store_chain(trio.a, chain, seed=902)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    ticket = trio.c.lookup(NS, chain).ticket
    holder_pool = trio.a.pools[namespace_key(NS)].pool
    trio.a.removed(NS, [chain[j]], [slots[j]])
    trio.a.slot_view(NS, slots[j])[:] = b"\xee" * SLOT_BYTES
    trio.a.stored(NS, [chain[j]], [slots[j]])
    wait_for(lambda: holder_pool.header(slots[j]).state == STORED, WAIT_S, "block j stored again")
    dst = trio.c.allocate(NS, BLOCKS).slots
    r = trio.c.fetch(NS, chain, dst, ticket=ticket)
    assert (r.valid_blocks, r.invalidated) == (j, BLOCKS - j)
    assert [slot_bytes(trio.c, s) for s in dst[:j]] == payload[:j]
    trio.c.free(NS, dst)


@pytest.mark.timeout(120)
def test_the_connector_seam_carries_the_ticket_and_a_refused_one_is_a_miss_not_an_outage(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(903, BLOCKS)
    _, payload = store_chain(trio.a, chain, seed=903)
    wait_prefix(agent_cluster, directory, chain, "a", BLOCKS, readers=[trio.c])
    seam = AgentSeam(ConnectorConfig(agent_socket=trio.agents["c"].engine_socket), NS, SLOT_BYTES)
    try:
        found = seam.lookup(chain)
        assert found.ticket and found.peer_blocks == BLOCKS
        assert found.path in ("host", "shm")  # shm once this module's fetches opened it
        slots = seam.reserve(BLOCKS)
        bad = found.ticket[:-1] + bytes([found.ticket[-1] ^ 1])
        assert seam.fetch(chain, 0, slots, bad).valid_blocks == 0
        assert seam.available()  # the agent is fine: no agent_retry_s back-off
        r = seam.fetch(chain, 0, slots, found.ticket)
        assert r.valid_blocks == BLOCKS
        assert [bytes(seam.pool.slot_view(s)) for s in slots] == payload
        seam.release(slots)
    finally:
        seam.close()
