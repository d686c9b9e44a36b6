"""The agent's Prometheus endpoint, scraped over HTTP from real agent processes."""

from __future__ import annotations

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.core.wire import namespace_key
from kvdir.local import LocalCluster, wait_for
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    NS,
    SLOT_BYTES,
    WAIT_S,
    chain_of,
    scrape,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration

QUEUE = "kvdir_agent_publish_queue_depth"
BYTES_TCP = 'kvdir_agent_fetch_bytes_total{transport="tcp"}'
BYTES_SHM = 'kvdir_agent_fetch_bytes_total{transport="shm"}'
FAILURES = "kvdir_agent_validation_failures_total"


@pytest.mark.timeout(120)
def test_fetch_and_validation_metrics_follow_the_traffic(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    b_addr = trio.agents["b"].metrics_address
    c_addr = trio.agents["c"].metrics_address
    b0, c0 = scrape(b_addr), scrape(c_addr)
    for page in (b0, c0, scrape(trio.agents["a"].metrics_address)):
        assert QUEUE in page and FAILURES in page
        assert page[QUEUE] >= 0

    chain = chain_of(600, 4)
    slots, _ = store_chain(trio.a, chain, seed=600)
    wait_prefix(agent_cluster, directory, chain, "a", 4, readers=[trio.b, trio.c])
    a_addr = trio.agents["a"].metrics_address
    wait_for(lambda: scrape(a_addr)[QUEUE] == 0, WAIT_S, "a's publish queue to drain")

    # b reads over tcp, c over shm: all four blocks valid.
    for engine in (trio.b, trio.c):
        dst = engine.allocate(NS, 4).slots
        assert engine.fetch(NS, chain, dst).valid_blocks == 4
        engine.free(NS, dst)

    # The holder's engine evicts block 1 without telling anyone yet (a dropped
    # notification): the directory still offers it, validation must refuse it.
    pool = trio.a.pools[namespace_key(NS)].pool
    pool.evict(slots[1])
    dst = trio.b.allocate(NS, 4).slots
    r = trio.b.fetch(NS, chain, dst)
    assert (r.valid_blocks, r.invalidated) == (1, 3)
    trio.b.free(NS, dst)

    b1, c1 = scrape(b_addr), scrape(c_addr)
    assert b1[BYTES_TCP] - b0.get(BYTES_TCP, 0) == 8 * SLOT_BYTES  # 4 valid + 4 refused
    assert c1[BYTES_SHM] - c0.get(BYTES_SHM, 0) == 4 * SLOT_BYTES
    assert b1[FAILURES] - b0[FAILURES] == 3  # blocks, not fetches
    assert c1[FAILURES] == c0[FAILURES]
    assert b1[QUEUE] >= 0
    trio.a.free(NS, slots)
