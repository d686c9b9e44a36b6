"""Agents reading the directory from their in-process mirror (directory_mirror, the default).

The trio's agents run with the mirror on; one more agent runs with it off
(`--no-directory-mirror`, every lookup a gRPC call), so each answer is
checked against the RPC path's in the same run. Who answered is read from
the agents' own metrics (kvdir_agent_mirror_lookups{source}) and, in
process, from ReadInfo.replica_id ("mirror:<replica>").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdir.agent.config import from_dict
from kvdir.agent.directory_reads import mirror_reads
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, records
from kvdir.core.security import PLAIN
from kvdir.core.wire import namespace_key
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.v1 import agent_pb2 as apb
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    FALLBACK,
    FRESH,
    MODEL,
    NS,
    POOL_SPEC,
    SERVED,
    SLOT_BYTES,
    WAIT_S,
    chain_of,
    launch_all,
    scrape,
    slot_bytes,
    stop_all,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rpc_only(
    agent_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalAgent, EngineClient]]:
    base = str(tmp_path_factory.mktemp("rpc-only"))
    agent = LocalAgent(
        "rpc-only", base, agent_cluster.grpc_addresses, POOL_SPEC, lease_ms=15_000,
        extra_args=["--no-directory-mirror"],
    )  # fmt: skip
    launch_all([agent])
    engine = EngineClient(agent.engine_socket)
    try:
        yield agent, engine
    finally:
        engine.close()
        stop_all([agent])


def peers(resp: apb.EngineLookupResponse) -> list[tuple[str, int, tuple[str, ...]]]:
    return [(p.node_id, p.prefix_blocks, tuple(p.transports)) for p in resp.peers]


def wait_fresh(agent: LocalAgent) -> None:
    wait_for(lambda: scrape(agent.metrics_address).get(FRESH) == 1, WAIT_S, "a fresh mirror")


def counts(agent: LocalAgent) -> tuple[float, float]:
    page = scrape(agent.metrics_address)
    return page[SERVED], page[FALLBACK]


@pytest.mark.timeout(120)
def test_an_engine_lookup_is_answered_by_the_mirror_with_the_rpc_paths_peers(
    agent_cluster: LocalCluster,
    directory: DirectoryClient,
    trio: Trio,
    rpc_only: tuple[LocalAgent, EngineClient],
) -> None:
    rpc_agent, rpc_engine = rpc_only
    chain = chain_of(1700, 48)
    a_slots, _ = store_chain(trio.a, chain, seed=1700)
    c_slots, _ = store_chain(trio.c, chain[:20], seed=1701)
    wait_prefix(agent_cluster, directory, chain, "a", 48, readers=[trio.b])
    wait_prefix(agent_cluster, directory, chain, "c", 20, readers=[trio.b, trio.a])
    b = trio.agents["b"]
    wait_fresh(b)

    before = counts(b)
    from_mirror = trio.b.lookup(NS, chain)
    assert counts(b) == (before[0] + 1, before[1])  # the mirror answered, no RPC
    from_rpc = rpc_engine.lookup(NS, chain)
    assert peers(from_mirror) == peers(from_rpc)
    assert [(n, k) for n, k, _ in peers(from_mirror)] == [("a", 48), ("c", 20)]
    assert from_mirror.local_blocks == from_rpc.local_blocks == 0

    # The holder's own Lookup, from its mirror: its own blocks are local, never a peer.
    a = trio.agents["a"]
    before = counts(a)
    own = trio.a.lookup(NS, chain)
    assert counts(a) == (before[0] + 1, before[1])
    assert own.local_blocks == 48
    assert [(n, k) for n, k, _ in peers(own)] == [("c", 20)]

    page = scrape(b.metrics_address)
    assert 0 < page["kvdir_agent_mirror_applied_index"] <= page["kvdir_agent_mirror_commit_index"]
    assert page["kvdir_agent_mirror_snapshots"] >= 1
    assert not any(k.startswith("kvdir_agent_mirror_") for k in scrape(rpc_agent.metrics_address))
    trio.a.free(NS, a_slots)
    trio.c.free(NS, c_slots)


@pytest.mark.timeout(120)
def test_the_fetch_path_reads_the_mirror_and_a_stale_record_costs_a_miss(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    chain = chain_of(1710, 6)
    slots, payload = store_chain(trio.a, chain, seed=1710)
    wait_prefix(agent_cluster, directory, chain, "a", 6, readers=[trio.b])
    b = trio.agents["b"]
    wait_fresh(b)

    before = counts(b)
    dst = trio.b.allocate(NS, 6).slots
    r = trio.b.fetch(NS, chain, dst)
    assert (r.valid_blocks, r.source_node) == (6, "a")
    assert [slot_bytes(trio.b, s) for s in dst] == payload
    assert counts(b) == (before[0] + 1, before[1])  # one lookup, from the mirror

    # The holder's engine evicts block 2 and tells no one: the mirror still offers
    # it (the answer is stale, as a lagging mirror's would be). Validation ends the
    # prefix there: two valid blocks, never the evicted slot's new bytes.
    trio.a.pools[namespace_key(NS)].pool.evict(slots[2])
    trio.a.slot_view(NS, slots[2])[:] = b"\xee" * SLOT_BYTES
    before = counts(b)
    dst2 = trio.b.allocate(NS, 6).slots
    r = trio.b.fetch(NS, chain, dst2)
    assert (r.valid_blocks, r.invalidated) == (2, 4)
    assert [slot_bytes(trio.b, s) for s in dst2[:2]] == payload[:2]
    assert counts(b) == (before[0] + 1, before[1])
    trio.b.free(NS, dst + dst2)
    trio.a.free(NS, slots)


@pytest.mark.timeout(120)
def test_before_its_first_snapshot_the_mirror_hands_lookups_to_a_replica(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio
) -> None:
    """In process: the agent's own MirrorReads, on the real cluster."""
    chain = chain_of(1720, 5)
    slots, _ = store_chain(trio.a, chain, seed=1720)
    wait_prefix(agent_cluster, directory, chain, "a", 5)
    cfg = from_dict(
        {
            "node_id": "probe", "host": "127.0.0.1", "listen": "127.0.0.1:1",
            "directory": agent_cluster.grpc_addresses, "engine_socket": "unused.sock",
            "pools": [{"model": MODEL, "block_tokens": 16, "slot_bytes": SLOT_BYTES, "slots": 1}],
        }
    )  # fmt: skip
    reads = mirror_reads(cfg, directory, PLAIN)
    assert reads is not None
    rpc = directory.lookup(NS, chain, max_nodes=8)
    got = reads.lookup(NS, chain, 8)  # not started: no starting point yet
    assert not got.read.replica_id.startswith("mirror:")
    assert (reads.served, reads.fallbacks) == (0, 1)
    reads.start()
    try:
        wait_for(lambda: reads.lag().fresh and reads.mirror.applied_index >= rpc.read.applied_index,
                 WAIT_S, "the mirror to catch up")  # fmt: skip
        got = reads.lookup(NS, chain, 8)
        assert got.read.replica_id.startswith("mirror:")
        assert (reads.served, reads.fallbacks) == (1, 1)
        assert [(m.node_id, m.prefix_blocks) for m in got.matches] == [
            (m.node_id, m.prefix_blocks) for m in rpc.matches
        ]
        assert records(got.matches[0]) == records(rpc.matches[0])  # what the fetch path reads
        assert len(records(got.matches[0]).generations) == 5
        assert not reads.lookup(NS, chain, 8, exclude_node="a").matches
        # A namespace the agent has no pool for is not mirrored: a replica answers.
        other = type(NS)(model="not-a-pool", block_tokens=16)
        assert not reads.lookup(other, chain).read.replica_id.startswith("mirror:")
        assert reads.fallbacks == 2
    finally:
        reads.stop()
    trio.a.free(NS, slots)
