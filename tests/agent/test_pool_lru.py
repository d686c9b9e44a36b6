"""Allocate(evict): a full pool hands out its least recently used blocks.

A real `kvdir agent serve` with a tiny pool: once every slot holds a block,
an evicting allocation takes the blocks used least recently (a local lookup
hit counts as a use), bumps their generations before handing them out, and
withdraws them from the directory; a plain allocation still refuses.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdir.agent.engine.client import EngineClient, EngineError
from kvdir.core.client import DirectoryClient
from kvdir.core.wire import namespace_key
from kvdir.local import LocalAgent, LocalCluster
from tests.agent.helpers import BLOCK_TOKENS, MODEL, NS, SLOT_BYTES, chain_of, wait_prefix

pytestmark = pytest.mark.integration

SLOTS = 8


@pytest.fixture
def small(
    agent_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalAgent, EngineClient]]:
    spec = f"model={MODEL},block_tokens={BLOCK_TOKENS},slot_bytes={SLOT_BYTES},slots={SLOTS}"
    a = LocalAgent(
        "lru",
        str(tmp_path_factory.mktemp("lru")),
        agent_cluster.grpc_addresses,
        spec,
        lease_ms=15_000,
    )
    a.launch(60)
    e = EngineClient(a.engine_socket)
    try:
        yield a, e
    finally:
        e.close()
        a.stop()


@pytest.mark.timeout(120)
def test_a_full_pool_evicts_the_least_recently_used_blocks(
    agent_cluster: LocalCluster, directory: DirectoryClient, small: tuple[LocalAgent, EngineClient]
) -> None:
    _, e = small
    old, hot = chain_of(700, 4), chain_of(701, 4)
    for chain in (old, hot):
        alloc = e.allocate(NS, len(chain))
        e.stored(NS, chain, alloc.slots)
    e.flush()
    wait_prefix(agent_cluster, directory, old, "lru", 4)
    with pytest.raises(EngineError):
        e.allocate(NS, 1)  # full, and no eviction asked for
    hot_slots = list(e.lookup(NS, hot).local_slots)  # a use of `hot` ...
    assert e.lookup(NS, old).local_blocks == 4  # ... then of `old`: `hot` is now the LRU
    pool = e.pools[namespace_key(NS)].pool
    gens = dict(zip(hot_slots, pool.generations(hot_slots), strict=True))
    got = e.allocate(NS, 4, evict=True)
    assert sorted(got.slots) == sorted(hot_slots)  # `hot` was used least recently
    assert all(g > gens[s] for s, g in zip(got.slots, got.generations, strict=True))
    wait_prefix(agent_cluster, directory, hot, "lru", 0)
    assert e.lookup(NS, old).local_blocks == 4
    assert e.allocate(NS, 8, evict=True).slots  # more than the rest: partial is allowed
