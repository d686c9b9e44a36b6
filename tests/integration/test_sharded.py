"""The sharded directory end to end: 2 groups x 3 real replica processes behind one map.

A `ShardedDirectoryClient` and a `ShardedMirror` against real `kvdir directory
serve` groups (each started with --group/--shard-home, g0 holding the map),
compared with a single-group directory given the same writes; then a real
agent configured with a shard home; then a whole group killed.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, DirectoryError, records
from kvdir.core.sharded_client import GROUP_DOWN_S, ShardedDirectoryClient
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.core.wire import namespace_key
from kvdir.directory.lookup import Chain
from kvdir.gateway.lookup import DirectoryLookups
from kvdir.local import LocalAgent, LocalCluster, ShardedCluster, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.agent.helpers import NS, POOL_SPEC, chain_of, scrape, store_chain
from tests.integration.helpers import wait_all_serving

WAIT_S = 60.0
LEASE_MS = 600_000


def _serving(sc: ShardedCluster) -> None:
    for c in sc.clusters.values():
        wait_all_serving(c, WAIT_S)


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[ShardedCluster]:
    sc = ShardedCluster(str(tmp_path / "groups"), groups=2, size=3)
    try:
        sc.start(WAIT_S)
        _serving(sc)
        yield sc
    finally:
        sc.stop()


def _publish(c: DirectoryClient | ShardedDirectoryClient, rng: random.Random) -> list[bytes]:
    """Two holders of one 500-block chain (one with a hole, another tier), same records."""
    chain = [rng.randbytes(32) for _ in range(500)]
    for node in ("n-a", "n-b"):
        c.register_node(node, "127.0.0.1", 7, f"127.0.0.1:{len(node)}", ["tcp"], LEASE_MS)
    n = len(chain)
    c.publish("n-a", 7, NS, pb.TIER_GPU, chain, range(1, n + 1), [4096] * n, [9] * n, [3] * n)
    b = [i for i in range(300) if i != 170]
    c.publish(
        "n-b",
        7,
        NS,
        pb.TIER_HOST,
        [chain[i] for i in b],
        [10_000 + i for i in b],
        [2048] * len(b),
        [5] * len(b),
        [1] * len(b),
    )
    return chain


def _mirror(sc: ShardedDirectoryClient) -> tuple[ShardedMirror, ShardedMirrorSync]:
    m = ShardedMirror(sc.shard_map, max_staleness_s=1.0)
    return m, ShardedMirrorSync(m).start()


def test_sharded_answers_equal_a_single_group_run(sharded: ShardedCluster, tmp_path: Path) -> None:
    single = LocalCluster(str(tmp_path / "single"), size=1)
    single.start(WAIT_S)
    try:
        with (
            ShardedDirectoryClient(sharded.home.grpc_addresses, timeout_s=10) as sc,
            single.client(timeout_s=10) as one,
        ):
            assert sc.shard_map.version == 1 and sc.group_ids() == ["g0", "g1"]
            chain = _publish(sc, random.Random(1))
            _publish(one, random.Random(1))
            parts = sc.shard_map.positions_by_group(chain)
            assert len(parts) == 2 and all(len(p) > 150 for p in parts.values())
            want = one.lookup(NS, chain).matches
            assert [(m.node_id, m.prefix_blocks) for m in want] == [("n-a", 500), ("n-b", 170)]
            assert list(sc.lookup(NS, chain).matches) == list(want)
            # Each group holds only its own blocks (a replica refuses the rest).
            for g, p in parts.items():
                part = [chain[i] for i in p]
                got = sc.group_client(g).lookup(NS, part).matches
                assert (got[0].node_id, got[0].prefix_blocks) == ("n-a", len(p))
            listed = {n.node_id: n.entries for n in sc.list_nodes().nodes}
            assert listed == {n.node_id: n.entries for n in one.list_nodes().nodes}
            mirror, sync = _mirror(sc)
            try:
                wait_for(
                    lambda: mirror.fresh() and len(mirror.lookup(NS, chain).matches) == 2,
                    WAIT_S,
                    "the sharded mirror to hold both holders",
                )
                assert list(mirror.lookup(NS, chain).matches) == list(want)
                # The gateway's routing form, from the mirror and over the RPC path.
                lengths = [(m.node_id, m.prefix_blocks) for m in want]
                key = namespace_key(NS)
                assert mirror.prefix_lengths(key, Chain.of(chain), 8) == lengths
                assert [x[:2] for x in mirror.holders(key, Chain.of(chain), 8)] == lengths
            finally:
                sync.stop()
            assert asyncio.run(_gateway_prompt(sharded.home.grpc_addresses, chain)) == dict(lengths)
    finally:
        single.stop()


async def _gateway_prompt(home: list[str], chain: list[bytes]) -> dict[str, int]:
    """Who holds `chain`, as the gateway's batched RPC path asks a sharded directory."""
    client = ShardedDirectoryClient(home, timeout_s=10)
    rpc = DirectoryLookups(home, 10.0, 1.0, 32, sharded=client)
    rpc.start()
    try:
        p = await rpc.prompt(NS, chain)
    finally:
        await rpc.stop()
    assert p is not None
    return {n: h.prefix_blocks for n, h in p.holders.items()}


def _agent_config(tmp_path: Path, home: list[str]) -> str:
    path = tmp_path / "agent.toml"
    path.write_text(f"shard_home = {home!r}\n".replace("'", '"'))
    return str(path)


def test_agent_publishes_to_every_group_and_a_dead_group_is_a_miss(
    sharded: ShardedCluster, tmp_path: Path
) -> None:
    cfg = _agent_config(tmp_path, sharded.home.grpc_addresses)
    # LocalAgent always names --directory: an empty one leaves the shard home alone.
    agent = LocalAgent(
        "sharded-agent",
        str(tmp_path / "agents"),
        [],
        POOL_SPEC,
        lease_ms=2000,
        extra_args=["--config", cfg],
    )
    agent.launch(WAIT_S)
    sc = ShardedDirectoryClient(sharded.home.grpc_addresses, timeout_s=10)
    mirror, sync = _mirror(sc)
    try:
        engine = EngineClient(agent.engine_socket)
        chain = chain_of(31, 48)
        store_chain(engine, chain, seed=3)
        engine.close()
        parts = sc.shard_map.positions_by_group(chain)
        assert len(parts) == 2

        def holds(reads: ShardedDirectoryClient | ShardedMirror, blocks: int) -> bool:
            got = {m.node_id: m.prefix_blocks for m in reads.lookup(NS, chain).matches}
            return got.get("sharded-agent", 0) == blocks

        wait_for(lambda: holds(sc, 48), WAIT_S, "the RPC lookup to see the agent's chain")
        wait_for(lambda: mirror.fresh() and holds(mirror, 48), WAIT_S, "the mirror to see it")
        # The agent's own mirror follows both groups (its per-group series).
        fresh = [f'kvdir_agent_mirror_group_fresh{{group="{g}"}}' for g in ("g0", "g1")]
        wait_for(
            lambda: all(scrape(agent.metrics_address).get(k) == 1.0 for k in fresh),
            WAIT_S,
            "the agent's mirror of every group to be fresh",
        )
        for g in parts:  # registered, and holding its part, in every group
            listed = {n.node_id: n.entries for n in sc.group_client(g).list_nodes().nodes}
            assert listed.get("sharded-agent") == len(parts[g])

        # A static holder with a long lease, then the agent crashes: its records
        # go from every group after its lease, the static holder's stay.
        static = chain_of(32, 64)
        n = len(static)
        sc.register_node("static", "127.0.0.1", 1, "127.0.0.1:9", ["tcp"], LEASE_MS)
        sc.publish("static", 1, NS, pb.TIER_GPU, static, range(1, n + 1), [1] * n, [2] * n, [3] * n)
        agent.kill(signal.SIGKILL)

        def gone_everywhere() -> bool:
            return all(
                "sharded-agent" not in {x.node_id for x in sc.group_client(g).list_nodes().nodes}
                for g in sc.group_ids()
            )

        wait_for(gone_everywhere, WAIT_S, "the crashed agent to expire in every group")
        wait_for(lambda: holds(sc, 0), WAIT_S, "its records to go")
        wait_for(lambda: holds(mirror, 0), WAIT_S, "the mirror to drop its records")

        # Kill every replica of g1: lookups still answer, prefixes end at g1's first block.
        cut = sc.shard_map.positions_by_group(static)["g1"][0]
        g1 = sharded.clusters["g1"]
        for rep in g1.replicas:
            g1.kill(rep, signal.SIGKILL)
        t0 = time.monotonic()
        resp = sc.lookup(NS, static)
        first = time.monotonic() - t0
        again = time.monotonic()
        resp2 = sc.lookup(NS, static)
        second = time.monotonic() - again
        for r in (resp, resp2):
            got = {m.node_id: m for m in r.matches}
            if cut == 0:
                assert "static" not in got
                continue
            assert got["static"].prefix_blocks == cut
            assert records(got["static"]).addresses == list(range(1, cut + 1))
        # The first lookup waits out the group's deadline once; then it is known down.
        assert first < 1.0 + 2.0 and second < GROUP_DOWN_S / 2, (first, second)

        # A write spanning the dead group fails, naming the part g0 committed.
        fresh_chain = chain_of(33, 32)
        k = len(fresh_chain)
        short = ShardedDirectoryClient(sharded.home.grpc_addresses, timeout_s=2)
        try:
            with pytest.raises(DirectoryError) as failed:
                short.publish(
                    "static", 1, NS, pb.TIER_GPU, fresh_chain, range(k), [1] * k, [1] * k, [1] * k
                )
        finally:
            short.close()
        g0_part = short.shard_map.positions_by_group(fresh_chain)["g0"]
        assert list(failed.value.committed) == g0_part

        def mirror_cut() -> bool:
            got = {m.node_id: m.prefix_blocks for m in mirror.lookup(NS, static).matches}
            return got.get("static", 0) == cut

        wait_for(mirror_cut, WAIT_S, "the mirror to end prefixes at g1's first block")
    finally:
        sync.stop()
        sc.close()
        agent.stop()
