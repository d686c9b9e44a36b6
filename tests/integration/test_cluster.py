"""The directory API on a healthy 3-replica cluster of real processes."""

from __future__ import annotations

import functools
import json
import threading

import grpc
import pytest

from kvdir.core.client import DirectoryClient, DirectoryError, records
from kvdir.local import LocalCluster, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.integration.helpers import (
    BLOCK_BYTES,
    RKEY,
    address_of,
    chain,
    followers,
    live,
    ns,
    prefixes,
    publish,
    raw_stub,
    register,
    rpc_error,
    trailers,
    wait_all_connected,
    wait_converged,
    wait_local_prefixes,
)

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_a_write_sent_to_a_follower_reaches_the_leader_and_every_replica(
    shared_cluster: LocalCluster,
) -> None:
    space = ns("cluster/publish-via-follower")
    blocks = chain(40, salt=1)
    writer, reader = followers(shared_cluster)
    # The client knows only a follower: the follower refuses the write and names the
    # leader (it does not forward it: a forwarded copy could land after the client's
    # retry and its next write), and the client goes there.
    with DirectoryClient([writer.grpc_address], timeout_s=10) as w:
        register(w, "pv-node")
        resp = publish(w, "pv-node", 1, space, blocks)
        leader = w.preferred()
    assert (resp.applied, resp.stale) == (40, 0)
    assert leader not in (writer.grpc_address, reader.grpc_address)
    assert resp.applied_index > 0

    with shared_cluster.client(timeout_s=10) as c:
        # A linearizable read on the *other* follower sees the publish at once.
        lin = c.lookup(space, blocks, address=reader.grpc_address, linearizable=True)
        assert lin.read.linearizable
        assert lin.read.replica_id == reader.replica_id
        assert lin.read.role == pb.ROLE_FOLLOWER
        assert lin.read.applied_index >= resp.applied_index
        assert prefixes(lin) == [("pv-node", 40)]
        m = lin.matches[0]
        rec = records(m)
        assert rec.addresses == [address_of(i) for i in range(40)]
        assert rec.lengths == [BLOCK_BYTES] * 40
        assert rec.rkeys == [RKEY] * 40
        assert rec.generations == [1] * 40
        assert rec.tiers == [pb.TIER_GPU] * 40
        assert m.host == "127.0.0.1"
        assert list(m.transports) == ["tcp", "shm"]

        # Local reads converge on every replica, the leader included.
        wait_local_prefixes(c, shared_cluster.replicas, space, blocks, [("pv-node", 40)])
        # A longer query chain matches the published prefix; another chain matches nothing.
        longer = [*blocks, *chain(10, salt=1, start=1000)]
        assert prefixes(c.lookup(space, longer, linearizable=True)) == [("pv-node", 40)]
        assert prefixes(c.lookup(space, chain(5, salt=99), linearizable=True)) == []
        # The same hashes in another namespace are another key.
        assert prefixes(c.lookup(ns("cluster/other-model"), blocks, linearizable=True)) == []
        # omit_records keeps the prefix lengths and drops the columns.
        bare = c.lookup(space, blocks, linearizable=True, omit_records=True)
        assert prefixes(bare) == [("pv-node", 40)]
        assert records(bare.matches[0]).addresses == []
        assert not bare.matches[0].addresses
        assert not bare.matches[0].tiers


@pytest.mark.timeout(60)
def test_block_ids_and_block_hashes_name_the_same_key(client: DirectoryClient) -> None:
    space = ns("cluster/ids")
    ids = [0xFFFF_FFFF_FFFF_FFF0 + i for i in range(5)]
    register(client, "ids-node")
    publish(client, "ids-node", 1, space, [i.to_bytes(8, "big") for i in ids])
    req = pb.LookupRequest(namespace=space, block_ids=ids, linearizable=True)
    resp = client.call("Lookup", req)
    assert prefixes(resp) == [("ids-node", 5)]


@pytest.mark.timeout(60)
def test_lookup_batch(shared_cluster: LocalCluster, client: DirectoryClient) -> None:
    space = ns("cluster/batch")
    a, b = chain(30, salt=2), chain(12, salt=3)
    for node, blocks in (("batch-a", a), ("batch-b", b)):
        register(client, node)
        publish(client, node, 1, space, blocks)
    lookups = [
        pb.LookupRequest(namespace=space, block_hashes=a),
        pb.LookupRequest(namespace=space, block_hashes=b, omit_records=True),
        pb.LookupRequest(namespace=space, block_hashes=chain(3, salt=4)),
        pb.LookupRequest(namespace=space, block_hashes=a[:7], exclude_node="batch-a"),
    ]
    follower = followers(shared_cluster)[0]
    resp = client.lookup_batch(lookups, linearizable=True, address=follower.grpc_address)
    assert resp.read.linearizable
    assert resp.read.replica_id == follower.replica_id
    assert len(resp.results) == 4
    got = [[(m.node_id, m.prefix_blocks) for m in r.matches] for r in resp.results]
    assert got == [[("batch-a", 30)], [("batch-b", 12)], [], []]
    assert records(resp.results[0].matches[0]).addresses == [address_of(i) for i in range(30)]
    assert not resp.results[1].matches[0].addresses
    assert not any(r.HasField("read") for r in resp.results)

    # The same batch as local reads converges on every replica.
    def converged(address: str) -> bool:
        r = client.lookup_batch(lookups, address=address)
        assert not r.read.linearizable
        return [[(m.node_id, m.prefix_blocks) for m in x.matches] for x in r.results] == got

    for r in shared_cluster.replicas:
        wait_for(
            functools.partial(converged, r.grpc_address),
            5,
            f"{r.replica_id}'s local batch lookup to converge",
        )


@pytest.mark.timeout(60)
def test_exclude_node_and_max_nodes(client: DirectoryClient) -> None:
    space = ns("cluster/ranking")
    blocks = chain(20, salt=5)
    # Four holders of the same chain with prefixes 20, 15, 15, 5.
    held = {"rank-a": 20, "rank-b": 15, "rank-c": 15, "rank-d": 5}
    for node, n in held.items():
        register(client, node)
        publish(client, node, 1, space, blocks[:n])

    def ask(max_nodes: int = 0, exclude: str = "") -> list[tuple[str, int]]:
        return prefixes(
            client.lookup(
                space, blocks, max_nodes=max_nodes, exclude_node=exclude, linearizable=True
            )
        )

    # Best first: longer prefix, then node id.
    everyone = [("rank-a", 20), ("rank-b", 15), ("rank-c", 15), ("rank-d", 5)]
    assert ask() == everyone
    assert ask(max_nodes=64) == everyone
    assert ask(max_nodes=1) == everyone[:1]
    assert ask(max_nodes=3) == everyone[:3]
    assert ask(exclude="rank-a") == everyone[1:]
    assert ask(max_nodes=2, exclude="rank-b") == [("rank-a", 20), ("rank-c", 15)]
    # Excluding a node nobody registered excludes nothing.
    assert ask(exclude="rank-nobody") == everyone
    # A holder missing a block in the middle only counts its prefix up to the gap.
    register(client, "rank-gap")
    publish(client, "rank-gap", 1, space, blocks[:3])
    publish(client, "rank-gap", 1, space, blocks[4:18], first=4)
    assert ("rank-gap", 3) in ask(max_nodes=64)


@pytest.mark.timeout(60)
def test_higher_incarnation_drops_old_entries(
    shared_cluster: LocalCluster, client: DirectoryClient
) -> None:
    space = ns("cluster/incarnation")
    blocks = chain(10, salt=6)
    first = register(client, "inc-node", incarnation=100)
    assert not first.replaced_incarnation
    assert first.lease_ms == 600_000
    publish(client, "inc-node", 100, space, blocks)
    assert prefixes(client.lookup(space, blocks, linearizable=True)) == [("inc-node", 10)]

    # Re-registering the same incarnation (an agent retrying) keeps the entries.
    again = register(client, "inc-node", incarnation=100)
    assert not again.replaced_incarnation
    assert prefixes(client.lookup(space, blocks, linearizable=True)) == [("inc-node", 10)]

    # The agent restarted: a higher incarnation drops everything the old one published.
    second = register(client, "inc-node", incarnation=101)
    assert second.replaced_incarnation
    assert prefixes(client.lookup(space, blocks, linearizable=True)) == []
    wait_local_prefixes(client, shared_cluster.replicas, space, blocks, [])

    # A publish from the old incarnation is refused, on the wire and through the client.
    leader = shared_cluster.wait_leader(10)
    stale = pb.PublishRequest(
        node_id="inc-node",
        incarnation=100,
        namespace=space,
        tier=pb.TIER_GPU,
        block_hashes=blocks[:1],
        addresses=[1],
        lengths=[1],
        rkeys=[1],
        generations=[1],
    )
    for r in shared_cluster.replicas:
        with raw_stub(r.grpc_address) as stub:
            e = rpc_error(functools.partial(stub.Publish, stale, timeout=10))
        if r is not leader:  # a follower takes no write: it names the leader
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (r.replica_id, e)
            assert trailers(e) == {
                "kvdir-outcome": "not-applied",
                "kvdir-leader": leader.grpc_address,
            }
            continue
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (r.replica_id, e)
        assert trailers(e).get("kvdir-reason") == "stale-incarnation"
        assert e.details()
        assert "100" in (e.details() or "")
    with pytest.raises(DirectoryError) as info:
        publish(client, "inc-node", 100, space, blocks)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.reason == "stale-incarnation"
    # Registering an older incarnation is refused the same way.
    with raw_stub(leader.grpc_address) as stub:
        old = pb.RegisterNodeRequest(node_id="inc-node", host="127.0.0.1", incarnation=99)
        e = rpc_error(lambda: stub.RegisterNode(old, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailers(e).get("kvdir-reason") == "stale-incarnation"

    # The new incarnation publishes normally.
    publish(client, "inc-node", 101, space, blocks[:4])
    assert prefixes(client.lookup(space, blocks, linearizable=True)) == [("inc-node", 4)]


@pytest.mark.timeout(60)
def test_clear_node_and_deregister(shared_cluster: LocalCluster, client: DirectoryClient) -> None:
    space_a, space_b = ns("cluster/clear-a"), ns("cluster/clear-b")
    blocks = chain(8, salt=7)
    register(client, "clear-node", incarnation=7)
    register(client, "clear-other", incarnation=7)
    for space in (space_a, space_b):
        publish(client, "clear-node", 7, space, blocks)
        publish(client, "clear-other", 7, space, blocks[:2])

    # Clearing one namespace leaves the other one and the other node alone.
    assert client.clear_node("clear-node", 7, space_a).removed == 8
    assert prefixes(client.lookup(space_a, blocks, linearizable=True)) == [("clear-other", 2)]
    assert prefixes(client.lookup(space_b, blocks, linearizable=True)) == [
        ("clear-node", 8),
        ("clear-other", 2),
    ]

    # A clear with a stale incarnation is refused.
    with pytest.raises(DirectoryError) as info:
        client.clear_node("clear-node", 6)
    assert info.value.reason == "stale-incarnation"

    # Deregistering clears every namespace and forgets the node.
    assert client.clear_node("clear-node", 7, deregister=True).removed == 8
    assert prefixes(client.lookup(space_b, blocks, linearizable=True)) == [("clear-other", 2)]
    listed = {
        n.node_id
        for n in client.list_nodes(address=shared_cluster.wait_leader(10).grpc_address).nodes
    }
    assert "clear-node" not in listed
    assert "clear-other" in listed
    # A forgotten node can no longer publish until it registers again.
    with pytest.raises(DirectoryError) as info:
        publish(client, "clear-node", 7, space_a, blocks)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.reason == "unknown-node"
    register(client, "clear-node", incarnation=7)
    publish(client, "clear-node", 7, space_a, blocks[:1])
    assert ("clear-node", 1) in prefixes(client.lookup(space_a, blocks, linearizable=True))


@pytest.mark.timeout(60)
def test_list_nodes(shared_cluster: LocalCluster, client: DirectoryClient) -> None:
    space = ns("cluster/list")
    client.register_node(
        "list-node", "10.1.2.3", 42, "10.1.2.3:9100", ["rdma", "tcp"], lease_ms=600_000
    )
    publish(client, "list-node", 42, space, chain(6, salt=8))

    def node_on(address: str) -> pb.NodeInfo | None:
        resp = client.list_nodes(address=address)
        assert not resp.read.linearizable
        found = [n for n in resp.nodes if n.node_id == "list-node"]
        assert [n.node_id for n in resp.nodes] == sorted(n.node_id for n in resp.nodes)
        return found[0] if found else None

    def listed(address: str) -> bool:
        n = node_on(address)
        return n is not None and n.entries == 6

    for r in shared_cluster.replicas:
        wait_for(
            functools.partial(listed, r.grpc_address),
            5,
            f"{r.replica_id} to list list-node with 6 entries",
        )
        n = node_on(r.grpc_address)
        assert n is not None
        assert (n.host, n.agent_endpoint, list(n.transports), n.incarnation) == (
            "10.1.2.3",
            "10.1.2.3:9100",
            ["rdma", "tcp"],
            42,
        )
        assert n.lease_expiry_ms > 0


def _frozen_objects(log_path: str) -> int:
    """The `frozen_objects` of the replica's start-up freeze record (0: not logged yet)."""
    with open(log_path) as f:
        for line in f:
            if '"kvdir.gc"' in line:
                rec = json.loads(line)
                if rec.get("component") == "directory":
                    return int(rec["frozen_objects"])
    return 0


def _freeze_logged(log_path: str) -> bool:
    return _frozen_objects(log_path) > 0


@pytest.mark.timeout(60)
def test_every_replica_freezes_its_start_up_objects(shared_cluster: LocalCluster) -> None:
    """`kvdir directory serve` takes its start-up objects out of the collector's walks
    once serving (kvdir/core/gc_freeze.py: a full walk of them stalled the Raft thread)."""
    for r in shared_cluster.replicas:
        logged = functools.partial(_freeze_logged, r.log_path)
        wait_for(logged, 20, f"{r.replica_id}'s freeze record")
        # gRPC, protobuf, pysyncobj and the daemon: tens of thousands of objects.
        assert _frozen_objects(r.log_path) > 10_000, r.replica_id


@pytest.mark.timeout(60)
def test_cluster_status(shared_cluster: LocalCluster, client: DirectoryClient) -> None:
    register(client, "status-node")
    publish(client, "status-node", 1, ns("cluster/status"), chain(3, salt=9))
    wait_all_connected(shared_cluster)
    st = wait_converged(shared_cluster)
    assert sorted(st) == ["r1", "r2", "r3"]
    leaders = [rid for rid, s in st.items() if s.role == pb.ROLE_LEADER]
    assert len(leaders) == 1
    leader = next(r for r in shared_cluster.replicas if r.replica_id == leaders[0])
    for rid, s in st.items():
        assert s.replica_id == rid
        assert s.role in (pb.ROLE_LEADER, pb.ROLE_FOLLOWER)
        assert s.leader_id == leader.replica_id
        assert s.leader_grpc_address == leader.grpc_address
        assert len(s.members) == 3
        assert sorted(m.replica_id for m in s.members) == ["r1", "r2", "r3"]
        assert [m.replica_id for m in s.members if m.is_self] == [rid]
        assert {m.grpc_address for m in s.members} == set(shared_cluster.grpc_addresses)
        assert s.applied_index == s.commit_index > 0
    one = st[leaders[0]]
    assert one.has_quorum
    assert len({s.term for s in st.values()}) == 1
    # Every replica holds the same table.
    assert {(s.entries, s.blocks, s.nodes, s.namespaces) for s in st.values()} == {
        (one.entries, one.blocks, one.nodes, one.namespaces)
    }
    assert one.entries >= 3
    assert one.nodes >= 1
    assert len(live(shared_cluster)) == 3


@pytest.mark.timeout(60)
def test_lease_expiry_drops_silent_node_and_keeps_heartbeating_one(
    shared_cluster: LocalCluster, client: DirectoryClient
) -> None:
    space = ns("cluster/lease")
    blocks = chain(4, salt=10)
    stop = threading.Event()
    beats: list[int] = []
    errors: list[BaseException] = []

    def heartbeat() -> None:
        with shared_cluster.client(timeout_s=2) as hb:
            # Bounded: at most 300 beats, 100 ms apart (30 s, beyond the test's timeout).
            for _ in range(300):
                try:
                    beats.append(hb.heartbeat("lease-alive", 5).lease_expiry_ms)
                except DirectoryError as e:
                    errors.append(e)
                    return
                if stop.wait(0.1):
                    return

    # The heartbeating node's lease leaves room for a slow beat on a busy machine;
    # the silent one has the shortest lease there is.
    alive_reg = register(client, "lease-alive", incarnation=5, lease_ms=1000)
    assert alive_reg.lease_ms == 1000
    t = threading.Thread(target=heartbeat, name="lease-heartbeat", daemon=True)
    t.start()
    try:
        silent_reg = register(client, "lease-silent", incarnation=5, lease_ms=500)
        assert silent_reg.lease_ms == 500
        publish(client, "lease-silent", 5, space, blocks[:2])
        publish(client, "lease-alive", 5, space, blocks)

        def silent_gone() -> bool:
            got = prefixes(client.lookup(space, blocks, linearizable=True))
            return got == [("lease-alive", 4)]

        wait_for(silent_gone, 5, "the silent node's lease to expire", 0.05)

        def forgotten(address: str) -> bool:
            return "lease-silent" not in {
                n.node_id for n in client.list_nodes(address=address).nodes
            }

        for r in shared_cluster.replicas:
            wait_for(
                functools.partial(forgotten, r.grpc_address),
                5,
                f"{r.replica_id} to forget the silent node",
            )
        wait_local_prefixes(client, shared_cluster.replicas, space, blocks, [("lease-alive", 4)])
        # It outlives its first lease (by two sweeps) only because it keeps beating.
        first_expiry = alive_reg.lease_expiry_ms
        wait_for(
            lambda: bool(beats) and beats[-1] > first_expiry + 1500,
            5,
            "a heartbeat half a second past the first lease's end",
        )
        assert prefixes(client.lookup(space, blocks, linearizable=True)) == [("lease-alive", 4)]
        assert not errors, errors
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    client.clear_node("lease-alive", 5, deregister=True)
