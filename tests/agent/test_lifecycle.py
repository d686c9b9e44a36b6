"""Agent life cycle against the real directory: restart re-publishes, a dead agent expires.

Each test launches (and SIGKILLs) its own agent process; the trio's "b"
(tcp only) is the reader that proves the bytes are still served.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient
from kvdir.local import LocalAgent, LocalCluster, wait_for
from tests.agent.conftest import Trio
from tests.agent.helpers import (
    NS,
    POOL_SPEC,
    WAIT_S,
    chain_of,
    launch_all,
    node_info,
    prefixes,
    slot_bytes,
    stop_all,
    store_chain,
    wait_prefix,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def solo(
    request: pytest.FixtureRequest, agent_cluster: LocalCluster, tmp_path: Path
) -> Iterator[LocalAgent]:
    """One agent of this test's own (node id from the test name)."""
    node_id = "solo-" + request.node.name.removeprefix("test_")[:24]
    agent = LocalAgent(node_id, str(tmp_path), agent_cluster.grpc_addresses, POOL_SPEC)
    try:
        launch_all([agent])
        yield agent
    finally:
        stop_all([agent])


@pytest.mark.timeout(120)
def test_a_restarted_agent_republishes_its_pool_under_a_new_incarnation(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio, solo: LocalAgent
) -> None:
    node = solo.node_id
    chain = chain_of(300, 10)
    engine = EngineClient(solo.engine_socket)
    try:
        slots, payload = store_chain(engine, chain, seed=300)
        wait_prefix(agent_cluster, directory, chain, node, 10)
    finally:
        engine.close()
    before = node_info(directory, node)
    assert before is not None
    old_incarnation, entries = before
    assert entries == 10
    pool_file = os.path.join(solo.pool_dir, f"kvdir-{node}-pool0")
    inode = os.stat(pool_file).st_ino

    solo.kill(signal.SIGKILL)  # no goodbye: nothing is withdrawn
    solo.launch()  # same node id, same pool dir; nobody calls stored() again

    def new_incarnation_listed() -> bool:
        info = node_info(directory, node)
        return info is not None and info[0] > old_incarnation and info[1] == 10

    wait_for(new_incarnation_listed, WAIT_S, f"{node} to re-register and re-publish", 0.05)
    wait_prefix(agent_cluster, directory, chain, node, 10, readers=[trio.b])
    assert os.stat(pool_file).st_ino == inode  # re-attached, not recreated

    # The restarted agent rebuilt its index from the pool headers...
    again = EngineClient(solo.engine_socket)
    try:
        local = again.lookup(NS, chain)
        assert (local.local_blocks, list(local.local_slots)) == (10, slots)
        assert [slot_bytes(again, s) for s in slots] == payload
    finally:
        again.close()
    # ...and serves the very same bytes to a peer under the re-published records.
    dst = trio.b.allocate(NS, 10).slots
    r = trio.b.fetch(NS, chain, dst)
    assert (r.valid_blocks, r.invalidated, r.source_node) == (10, 0, node)
    assert [slot_bytes(trio.b, s) for s in dst] == payload
    trio.b.free(NS, dst)


@pytest.mark.timeout(120)
def test_an_agent_killed_without_goodbye_expires_after_its_lease(
    agent_cluster: LocalCluster, directory: DirectoryClient, trio: Trio, solo: LocalAgent
) -> None:
    node = solo.node_id
    chain = chain_of(400, 4)
    engine = EngineClient(solo.engine_socket)
    try:
        store_chain(engine, chain, seed=400)
        wait_prefix(agent_cluster, directory, chain, node, 4)
    finally:
        engine.close()
    assert node_info(directory, node) is not None

    solo.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    lease_s = solo.lease_ms / 1000
    wait_prefix(agent_cluster, directory, chain, node, 0, timeout_s=lease_s + 8)
    wait_for(
        lambda: node_info(directory, node) is None,
        lease_s + 8,
        f"{node} to leave the node list",
        0.05,
    )
    # Not before the lease could have run out (a heartbeat may have renewed it at the kill).
    assert time.monotonic() - killed_at >= lease_s * 0.5
    # Readers see a clean miss, not an error.
    dst = trio.b.allocate(NS, 4).slots
    assert trio.b.fetch(NS, chain, dst).valid_blocks == 0
    trio.b.free(NS, dst)
    assert all(node not in prefixes(directory, chain, a) for a in agent_cluster.grpc_addresses)
