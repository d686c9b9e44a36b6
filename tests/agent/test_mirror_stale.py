"""A mirror cut off from every replica goes stale; the agent keeps answering local blocks.

Its own 3-replica directory (every replica is stopped and started again), an
agent `solo` with its own staleness bound and a holder `peer`. While the
directory is down, `solo`'s mirror turns stale after its bound, lookups go
to the RPC path (which fails), and the engine's Lookup still answers the
local prefix; once the replicas are back, the mirror resumes and answers again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from tests.agent.helpers import (
    FALLBACK,
    FRESH,
    NS,
    POOL_SPEC,
    SERVED,
    WAIT_S,
    chain_of,
    launch_all,
    scrape,
    stop_all,
    store_chain,
    wait_seen,
)

pytestmark = pytest.mark.integration

STALENESS_MS = 2000
"""Not the default (1000): the flag is exercised; long enough that a busy machine's
pauses between heartbeats (50 ms apart) do not turn the mirror stale."""
RESTART_S = 90.0
"""Three replicas restarting and electing a leader on a loaded 2-core machine."""


@dataclass
class World:
    cluster: LocalCluster
    solo: LocalAgent
    peer: LocalAgent
    solo_engine: EngineClient
    peer_engine: EngineClient


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cluster = LocalCluster(str(tmp_path_factory.mktemp("stale-directory")), size=3)
    base = str(tmp_path_factory.mktemp("stale-agents"))
    addrs = cluster.grpc_addresses
    solo = LocalAgent(
        "solo", base, addrs, POOL_SPEC, lease_ms=15_000,
        extra_args=["--directory-mirror-staleness-ms", str(STALENESS_MS)],
    )  # fmt: skip
    peer = LocalAgent("peer", base, addrs, POOL_SPEC, lease_ms=15_000)
    engines: list[EngineClient] = []
    try:
        cluster.start(timeout_s=60)
        launch_all([solo, peer])
        engines = [EngineClient(solo.engine_socket), EngineClient(peer.engine_socket)]
        yield World(cluster, solo, peer, *engines)
    finally:
        for e in engines:
            e.close()
        stop_all([solo, peer])
        cluster.stop()


def _lookup(agent: LocalAgent, chain: list[bytes]) -> tuple[apb.EngineLookupResponse, str]:
    """The engine's Lookup over the raw socket, and its kvdir-directory-error trailer."""
    with grpc.insecure_channel(f"unix:{agent.engine_socket}") as ch:
        resp, call = apb_grpc.EngineStub(ch).Lookup.with_call(
            apb.EngineLookupRequest(namespace=NS, block_hashes=chain), timeout=30
        )
    trailers = dict(call.trailing_metadata() or ())
    return resp, str(trailers.get("kvdir-directory-error", ""))


@pytest.mark.timeout(300)
def test_a_stale_mirror_falls_back_and_local_blocks_are_still_answered(world: World) -> None:
    chain = chain_of(1800, 6)
    store_chain(world.peer_engine, chain, seed=1800)
    mine, _ = store_chain(world.solo_engine, chain[:2], seed=1801)
    wait_seen(world.solo_engine, chain, "peer", 6)
    page = scrape(world.solo.metrics_address)
    assert page[FRESH] == 1 and page[SERVED] >= 1

    for r in world.cluster.replicas:
        world.cluster.kill(r, 15)  # SIGTERM: every replica goes away
    wait_for(
        lambda: scrape(world.solo.metrics_address)[FRESH] == 0,
        WAIT_S,
        "the mirror to turn stale with every replica gone",
    )
    before = scrape(world.solo.metrics_address)
    resp, error = _lookup(world.solo, chain)
    assert (resp.local_blocks, list(resp.local_slots), list(resp.peers)) == (2, mine, [])
    assert error  # the RPC fallback failed, and said so; the local answer stands
    after = scrape(world.solo.metrics_address)
    assert after[FALLBACK] == before[FALLBACK] + 1
    assert after[SERVED] == before[SERVED]

    for r in world.cluster.replicas:
        world.cluster.launch(r)
    world.cluster.wait_leader(RESTART_S)
    wait_for(
        lambda: scrape(world.solo.metrics_address)[FRESH] == 1,
        RESTART_S,
        "the mirror to resume on a restarted replica",
    )
    wait_seen(world.solo_engine, chain, "peer", 6, RESTART_S)
    before = scrape(world.solo.metrics_address)
    resp, error = _lookup(world.solo, chain)
    assert (resp.local_blocks, [(p.node_id, p.prefix_blocks) for p in resp.peers]) == (
        2,
        [("peer", 6)],
    )
    assert not error
    after = scrape(world.solo.metrics_address)
    assert (after[SERVED], after[FALLBACK]) == (before[SERVED] + 1, before[FALLBACK])
