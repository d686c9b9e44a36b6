"""Example-based tests of `Table` semantics (the replicated state machine)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvdir.directory.commands import (
    Barrier,
    ClearNode,
    Command,
    Done,
    Expired,
    ExpireNodes,
    Heartbeat,
    Publish,
    Published,
    Registered,
    Reject,
    Rejected,
    Remove,
    Removed,
    Renewed,
    Tier,
)
from kvdir.directory.limits import HOLDERS_PER_BLOCK_MAX
from kvdir.directory.table import Table

from .helpers import (
    NS,
    chain,
    h,
    holders,
    must_publish,
    must_register,
    node_entries_total,
    publish,
    publish_cmd,
    register,
    restored,
    view,
)

GPU = int(Tier.GPU)
HOST = int(Tier.HOST)


def rejected(res: object, reason: Reject) -> None:
    assert isinstance(res, Rejected), res
    assert res.reason == reason, res
    assert res.message


def two_nodes() -> Table:
    t = Table()
    must_register(t, "a")
    must_register(t, "b")
    return t


# ------------------------------------------------------------------ register


def test_register_new_node() -> None:
    t = Table()
    res = register(
        t,
        "n1",
        3,
        lease_ms=2_000,
        now_ms=500,
        host="h1",
        endpoint="10.0.0.1:7",
        transports=("rdma", "tcp"),
    )
    assert res == Registered(lease_expiry_ms=2_500, lease_ms=2_000, replaced_incarnation=False)
    node = t.nodes["n1"]
    assert (node.node_id, node.host, node.endpoint, node.transports) == (
        "n1",
        "h1",
        "10.0.0.1:7",
        ("rdma", "tcp"),
    )
    assert (node.incarnation, node.lease_ms, node.lease_expiry_ms, node.entries) == (
        3,
        2_000,
        2_500,
        0,
    )
    assert t.entries == 0


def test_reregister_same_incarnation_renews_and_keeps_entries() -> None:
    t = Table()
    must_register(t, "a", 5, lease_ms=1_000, now_ms=0)
    must_publish(t, "a", chain(3), incarnation=5)
    res = register(
        t,
        "a",
        5,
        lease_ms=3_000,
        now_ms=2_000,
        host="new-host",
        endpoint="ep:9",
        transports=("rdma",),
    )
    assert res == Registered(lease_expiry_ms=5_000, lease_ms=3_000, replaced_incarnation=False)
    node = t.nodes["a"]
    assert (node.host, node.endpoint, node.transports, node.lease_ms) == (
        "new-host",
        "ep:9",
        ("rdma",),
        3_000,
    )
    assert holders(t, chain(3)) == [("a", 3)]
    assert t.entries == node.entries == 3


def test_reregister_same_incarnation_never_shortens_the_lease() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=10_000, now_ms=1_000)
    res = register(t, "a", 1, lease_ms=1_000, now_ms=2_000)
    assert res == Registered(lease_expiry_ms=11_000, lease_ms=1_000, replaced_incarnation=False)
    assert t.nodes["a"].lease_expiry_ms == 11_000


def test_register_higher_incarnation_drops_old_entries() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(4))
    must_publish(t, "a", chain(2), ns="other", tier=HOST)
    must_publish(t, "b", chain(2))
    assert t.entries == 8
    res = register(t, "a", 2, lease_ms=1_000, now_ms=100)
    assert res == Registered(lease_expiry_ms=1_100, lease_ms=1_000, replaced_incarnation=True)
    assert t.nodes["a"].incarnation == 2
    assert t.nodes["a"].entries == 0
    assert t.entries == 2
    assert holders(t, chain(4)) == [("b", 2)]
    assert holders(t, chain(2), ns="other") == []
    # The old incarnation can no longer write; the new one can.
    rejected(publish(t, "a", chain(1), incarnation=1), Reject.STALE_INCARNATION)
    must_publish(t, "a", chain(1), incarnation=2)
    assert holders(t, chain(4)) == [("b", 2), ("a", 1)]


def test_register_lower_incarnation_is_rejected_and_changes_nothing() -> None:
    t = Table()
    must_register(t, "a", 7, lease_ms=1_000, now_ms=0)
    must_publish(t, "a", chain(2), incarnation=7)
    res = register(t, "a", 6, lease_ms=5_000, now_ms=50_000, host="zombie")
    rejected(res, Reject.STALE_INCARNATION)
    node = t.nodes["a"]
    assert (node.incarnation, node.host, node.lease_ms, node.lease_expiry_ms) == (
        7,
        "host",
        1_000,
        1_000,
    )
    assert holders(t, chain(2)) == [("a", 2)]


# ----------------------------------------------------------------- heartbeat


def test_heartbeat_renews_the_lease() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=1_000, now_ms=0)
    assert t.apply(Heartbeat("a", 1, 800)) == Renewed(1_800)
    assert t.nodes["a"].lease_expiry_ms == 1_800
    # A heartbeat stamped earlier (a new leader's clock) never shortens the lease.
    assert t.apply(Heartbeat("a", 1, 100)) == Renewed(1_800)


def test_heartbeat_unknown_node_rejected() -> None:
    t = Table()
    rejected(t.apply(Heartbeat("ghost", 1, 0)), Reject.UNKNOWN_NODE)
    assert t.nodes == {}


@pytest.mark.parametrize("incarnation", [1, 3])
def test_heartbeat_stale_incarnation_rejected(incarnation: int) -> None:
    t = Table()
    must_register(t, "a", 2, lease_ms=1_000, now_ms=0)
    rejected(t.apply(Heartbeat("a", incarnation, 900)), Reject.STALE_INCARNATION)
    assert t.nodes["a"].lease_expiry_ms == 1_000


# ------------------------------------------------------------------- publish


def test_publish_inserts_records() -> None:
    t = Table()
    must_register(t, "a")
    cmd = Publish("a", 1, NS, GPU, chain(3), [10, 20, 30], [1, 2, 3], [4, 5, 6], [7, 8, 9])
    assert t.apply(cmd) == Published(applied=3, stale=0)
    assert view(t, chain(3)) == [
        ("a", 3, ((10, 1, 4, 7, GPU), (20, 2, 5, 8, GPU), (30, 3, 6, 9, GPU)))
    ]
    assert t.entries == t.nodes["a"].entries == 3
    assert t.block_count == 3


def test_publish_updates_same_node_and_tier_in_place() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2), gen=1, addr=100)
    # Same generation and newer generations both apply.
    assert publish(t, "a", chain(2), gen=1, addr=200) == Published(2, 0)
    assert publish(t, "a", [h(1)], gen=5, addr=300, length=9, rkey=11) == Published(1, 0)
    assert view(t, chain(2)) == [("a", 2, ((200, 4096, 7, 1, GPU), (300, 9, 11, 5, GPU)))]
    assert t.entries == t.nodes["a"].entries == 2


def test_publish_stale_generation_is_counted_not_applied() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3), gen=5, addr=100)  # addresses 100, 101, 102
    cmd = Publish("a", 1, NS, GPU, chain(4), [100, 101, 102, 903], [1] * 4, [2] * 4, [4, 5, 6, 0])
    assert t.apply(cmd) == Published(applied=3, stale=1)
    rows = view(t, chain(4))[0][2]
    assert rows[0] == (100, 4096, 7, 5, GPU)  # same slot, gen 4 < 5: unchanged
    assert rows[1] == (101, 1, 2, 5, GPU)  # gen 5 == 5: applied
    assert rows[2] == (102, 1, 2, 6, GPU)
    assert rows[3] == (903, 1, 2, 0, GPU)  # new entry, any generation
    assert t.entries == 4


def test_publish_lower_generation_at_another_address_applies() -> None:
    """Generations order the publishes of one slot; a record for another slot
    means the block moved, and is newer whatever its generation."""
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2), gen=9, addr=100)
    cmd = Publish("a", 1, NS, GPU, chain(2), [500, 101], [1, 1], [2, 2], [1, 1])
    assert t.apply(cmd) == Published(applied=1, stale=1)
    assert view(t, chain(2)) == [("a", 2, ((500, 1, 2, 1, GPU), (101, 4096, 7, 9, GPU)))]
    # Now the older generation at the new address is what a same-slot publish is
    # compared with.
    assert publish(t, "a", [h(0)], gen=0, addr=500) == Published(0, 1)
    assert publish(t, "a", [h(0)], gen=1, addr=500) == Published(1, 0)


def test_publish_other_tier_is_a_separate_holder() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2), tier=GPU, gen=9)
    # A HOST copy is not compared with the GPU generation.
    assert publish(t, "a", chain(2), tier=HOST, gen=1) == Published(2, 0)
    assert t.entries == t.nodes["a"].entries == 4
    assert t.block_count == 2


def test_publish_within_one_batch_later_entry_wins() -> None:
    t = Table()
    must_register(t, "a")
    cmd = Publish("a", 1, NS, GPU, [h(0), h(0), h(0)], [1, 1, 1], [1, 2, 3], [1, 1, 1], [1, 3, 2])
    assert t.apply(cmd) == Published(applied=2, stale=1)
    assert view(t, [h(0)]) == [("a", 1, ((1, 2, 1, 3, GPU),))]
    assert t.entries == 1


@pytest.mark.parametrize("tier", [0, 3, 255])
def test_publish_bad_tier_rejected(tier: int) -> None:
    t = Table()
    must_register(t, "a")
    rejected(publish(t, "a", chain(2), tier=tier), Reject.BAD_TIER)
    assert t.entries == 0
    assert t.block_count == 0


@pytest.mark.parametrize("column", ["addresses", "lengths", "rkeys", "generations", "hashes"])
def test_publish_column_length_mismatch_rejected(column: str) -> None:
    t = Table()
    must_register(t, "a")
    hashes = chain(3)
    cols = {name: [1, 2, 3] for name in ("addresses", "lengths", "rkeys", "generations")}
    if column == "hashes":
        hashes = hashes[:2]
    else:
        cols[column] = cols[column][:2]
    cmd = Publish(
        "a",
        1,
        NS,
        GPU,
        hashes,
        cols["addresses"],
        cols["lengths"],
        cols["rkeys"],
        cols["generations"],
    )
    rejected(t.apply(cmd), Reject.BAD_BATCH)
    assert t.entries == 0
    assert holders(t, chain(3)) == []


def test_publish_unknown_node_and_stale_incarnation_rejected() -> None:
    t = Table()
    rejected(publish(t, "ghost", chain(1)), Reject.UNKNOWN_NODE)
    must_register(t, "a", 2)
    rejected(publish(t, "a", chain(1), incarnation=1), Reject.STALE_INCARNATION)
    rejected(publish(t, "a", chain(1), incarnation=3), Reject.STALE_INCARNATION)
    assert t.entries == 0


def test_lookup_unknown_namespace_is_empty() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2))
    assert t.lookup("no-such-namespace", chain(2), 8) == []
    assert t.lookup(NS, [], 8) == []
    assert t.lookup(NS, chain(2), 0) == []


def test_namespaces_are_separate() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(2), ns="n1")
    must_publish(t, "b", chain(2), ns="n2")
    assert holders(t, chain(2), ns="n1") == [("a", 2)]
    assert holders(t, chain(2), ns="n2") == [("b", 2)]


# -------------------------------------------------------------------- remove


def test_remove_without_generations_removes_any_generation() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(3), gen=9)
    must_publish(t, "a", chain(3), tier=HOST)
    must_publish(t, "b", chain(3))
    res = t.apply(Remove("a", 1, NS, GPU, [h(1), h(2), h(77)]))
    assert res == Removed(2)
    assert t.entries == 7
    assert t.nodes["a"].entries == 4
    # a's GPU copy of block 0 remains; its HOST copies are untouched.
    assert view(t, chain(3), exclude="b") == [
        (
            "a",
            3,
            ((0x1000, 4096, 7, 9, GPU), (0x1001, 4096, 7, 1, HOST), (0x1002, 4096, 7, 1, HOST)),
        )
    ]
    assert holders(t, chain(3), ns=NS)[0] == ("a", 3)
    assert ("b", 3) in holders(t, chain(3))


def test_remove_with_generations_guard() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3), gen=5)
    # Older than stored: kept. Equal or newer: removed.
    res = t.apply(Remove("a", 1, NS, GPU, chain(3), [4, 5, 6]))
    assert res == Removed(2)
    assert view(t, chain(3)) == [("a", 1, ((0x1000, 4096, 7, 5, GPU),))]
    assert t.entries == 1


def test_remove_with_older_generation_does_nothing() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2), gen=10)
    before = view(t, chain(2))
    assert t.apply(Remove("a", 1, NS, GPU, chain(2), [9, 0])) == Removed(0)
    assert view(t, chain(2)) == before
    assert t.entries == 2


def test_remove_unknown_namespace_and_other_tier() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2))
    assert t.apply(Remove("a", 1, "elsewhere", GPU, chain(2))) == Removed(0)
    assert t.apply(Remove("a", 1, NS, HOST, chain(2))) == Removed(0)
    assert t.apply(Remove("a", 1, NS, 9, chain(2))) == Removed(0)
    assert t.entries == 2


def test_remove_is_idempotent() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3))
    cmd = Remove("a", 1, NS, GPU, [h(1)])
    assert t.apply(cmd) == Removed(1)
    assert t.apply(cmd) == Removed(0)
    assert holders(t, chain(3)) == [("a", 1)]


def test_remove_unknown_node_and_stale_incarnation_rejected() -> None:
    t = Table()
    rejected(t.apply(Remove("ghost", 1, NS, GPU, chain(1))), Reject.UNKNOWN_NODE)
    must_register(t, "a", 2)
    must_publish(t, "a", chain(1), incarnation=2)
    rejected(t.apply(Remove("a", 1, NS, GPU, chain(1))), Reject.STALE_INCARNATION)
    assert t.entries == 1


@pytest.mark.parametrize(
    ("generations", "addresses"),
    [([1], []), ([], [0x1000]), ([1, 1, 1, 1], []), ([1, 1, 1], [0x1000, 0x1001])],
)
def test_remove_guard_length_mismatch_is_refused_not_raised(
    generations: list[int], addresses: list[int]
) -> None:
    """`Table.apply` never raises on input, and refuses a batch before changing
    anything (no partial remove)."""
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3))
    res = t.apply(Remove("a", 1, NS, GPU, chain(3), generations, addresses))
    rejected(res, Reject.BAD_BATCH)
    assert t.entries == 3
    assert holders(t, chain(3)) == [("a", 3)]


def test_remove_with_addresses_guard() -> None:
    """A remove names the slot it frees; a block re-published elsewhere stays."""
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3), addr=100)  # addresses 100, 101, 102
    res = t.apply(Remove("a", 1, NS, GPU, chain(3), [], [100, 999, 102]))
    assert res == Removed(2)
    assert view(t, chain(3)) == []
    assert view(t, [h(1), h(0)]) == [("a", 1, ((101, 4096, 7, 1, GPU),))]
    # Both guards at once: each must hold.
    must_publish(t, "a", [h(0)], addr=100, gen=4)
    assert t.apply(Remove("a", 1, NS, GPU, [h(0), h(1)], [3, 9], [100, 101])) == Removed(1)
    assert t.apply(Remove("a", 1, NS, GPU, [h(0)], [4], [100])) == Removed(1)
    assert t.entries == 0


# ---------------------------------------------------------------- clear node


def populated() -> Table:
    t = two_nodes()
    must_publish(t, "a", chain(3), ns="n1")
    must_publish(t, "a", chain(2), ns="n1", tier=HOST)
    must_publish(t, "a", chain(4), ns="n2")
    must_publish(t, "b", chain(2), ns="n1")
    must_publish(t, "b", chain(2), ns="n2")
    return t


def test_clear_node_all_namespaces() -> None:
    t = populated()
    assert t.apply(ClearNode("a", 1, None, False)) == Removed(9)
    assert "a" in t.nodes
    assert t.nodes["a"].entries == 0
    assert t.entries == 4
    assert holders(t, chain(4), ns="n1") == [("b", 2)]
    assert holders(t, chain(4), ns="n2") == [("b", 2)]
    must_publish(t, "a", chain(1), ns="n1")  # still registered: may publish again


def test_clear_node_one_namespace() -> None:
    t = populated()
    assert t.apply(ClearNode("a", 1, "n1", False)) == Removed(5)
    assert t.nodes["a"].entries == 4
    assert t.entries == 8
    assert holders(t, chain(4), ns="n1") == [("b", 2)]
    assert holders(t, chain(4), ns="n2") == [("a", 4), ("b", 2)]
    assert t.apply(ClearNode("a", 1, "never-used", False)) == Removed(0)


def test_clear_node_deregister_forgets_the_node() -> None:
    t = populated()
    assert t.apply(ClearNode("a", 1, None, True)) == Removed(9)
    assert "a" not in t.nodes
    assert t.entries == node_entries_total(t) == 4
    rejected(t.apply(Heartbeat("a", 1, 0)), Reject.UNKNOWN_NODE)
    rejected(publish(t, "a", chain(1), ns="n1"), Reject.UNKNOWN_NODE)
    # A fresh registration (any incarnation) starts clean.
    assert register(t, "a", 1) == Registered(1_000, 1_000, False)
    assert t.nodes["a"].entries == 0
    assert holders(t, chain(4), ns="n2") == [("b", 2)]


def test_clear_node_rejections() -> None:
    t = populated()
    rejected(t.apply(ClearNode("ghost", 1, None, True)), Reject.UNKNOWN_NODE)
    rejected(t.apply(ClearNode("a", 2, None, True)), Reject.STALE_INCARNATION)
    assert "a" in t.nodes
    assert t.entries == 13


def test_clear_one_namespace_and_deregister_leaves_no_orphans() -> None:
    """A node that leaves takes every entry with it, whatever namespace was
    named: entries must never outlive the node index they point at (they would
    crash lookups, or be served as the next registered node's)."""
    t = populated()
    assert t.apply(ClearNode("a", 1, "n1", True)) == Removed(9)
    assert "a" not in t.nodes
    assert t.entries == node_entries_total(t) == 4
    assert holders(t, chain(4), ns="n2") == [("b", 2)]
    must_register(t, "c")  # reuses a's node index
    assert t.nodes["c"].entries == 0
    assert holders(t, chain(4), ns="n2") == [("b", 2)]
    assert t.entries == node_entries_total(t) == 4


# -------------------------------------------------------------------- expire


def test_expire_only_expired_nodes_with_matching_incarnation() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=1_000, now_ms=0)  # expires at 1000
    must_register(t, "b", 1, lease_ms=5_000, now_ms=0)  # expires at 5000
    must_register(t, "c", 2, lease_ms=1_000, now_ms=0)  # expires at 1000
    must_register(t, "d", 1, lease_ms=1_000, now_ms=0)
    for n, inc in (("a", 1), ("b", 1), ("c", 2), ("d", 1)):
        must_publish(t, n, chain(2), incarnation=inc)
    cmd = ExpireNodes(1_000, (("a", 1), ("b", 1), ("c", 1), ("ghost", 1), ("d", 1)))
    assert t.apply(cmd) == Expired(nodes=("a", "d"), removed=4)
    assert sorted(t.nodes) == ["b", "c"]
    assert t.entries == node_entries_total(t) == 4
    assert holders(t, chain(2)) == [("b", 2), ("c", 2)]
    # Applying the same expiry again is a no-op.
    assert t.apply(cmd) == Expired(nodes=(), removed=0)


def test_expire_boundary_is_inclusive() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=1_000, now_ms=0)
    assert t.apply(ExpireNodes(999, (("a", 1),))) == Expired((), 0)
    assert t.apply(ExpireNodes(1_000, (("a", 1),))) == Expired(("a",), 0)


def test_node_renewed_after_the_decision_survives() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=1_000, now_ms=0)
    must_register(t, "b", 1, lease_ms=1_000, now_ms=0)
    must_publish(t, "a", chain(2))
    decided = t.expired_nodes(1_500, 10)
    assert decided == [("a", 1), ("b", 1)]
    # a's heartbeat commits between the leader's decision and its ExpireNodes.
    assert t.apply(Heartbeat("a", 1, 1_400)) == Renewed(2_400)
    assert t.apply(ExpireNodes(1_500, tuple(decided))) == Expired(("b",), 0)
    assert holders(t, chain(2)) == [("a", 2)]


def test_restarted_node_survives_expiry_of_its_old_incarnation() -> None:
    t = Table()
    must_register(t, "a", 1, lease_ms=1_000, now_ms=0)
    decided = t.expired_nodes(2_000, 10)
    must_register(t, "a", 2, lease_ms=1_000, now_ms=0)
    must_publish(t, "a", chain(1), incarnation=2)
    assert t.apply(ExpireNodes(2_000, tuple(decided))) == Expired((), 0)
    assert holders(t, chain(1)) == [("a", 1)]


def test_expired_nodes_sorted_limited_inclusive() -> None:
    t = Table()
    for name, lease in (("c", 1_000), ("a", 1_000), ("b", 3_000), ("d", 500)):
        must_register(t, name, 4, lease_ms=lease, now_ms=0)
    assert t.expired_nodes(499, 10) == []
    assert t.expired_nodes(500, 10) == [("d", 4)]
    assert t.expired_nodes(1_000, 10) == [("a", 4), ("c", 4), ("d", 4)]
    assert t.expired_nodes(1_000, 2) == [("a", 4), ("c", 4)]
    assert t.expired_nodes(10_000, 0) == []


def test_barrier_is_a_no_op() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(2))
    before = view(t, chain(2))
    assert t.apply(Barrier()) == Done()
    assert view(t, chain(2)) == before


# ---------------------------------------------------------------- holder cap


def test_holder_cap_replaces_the_oldest_holder() -> None:
    t = Table()
    names = [f"n{i:03d}" for i in range(HOLDERS_PER_BLOCK_MAX + 1)]
    for name in names:
        must_register(t, name)
    for name in names[:-1]:
        must_publish(t, name, chain(2))
    assert t.entries == 2 * HOLDERS_PER_BLOCK_MAX
    assert len(t.lookup(NS, chain(2), 1_000)) == HOLDERS_PER_BLOCK_MAX
    # Updating an existing holder at the cap evicts nobody.
    assert publish(t, names[5], [h(0)], gen=2) == Published(1, 0)
    assert t.entries == 2 * HOLDERS_PER_BLOCK_MAX
    # A new holder of block 0 evicts the first one to publish it (n000).
    assert publish(t, names[-1], [h(0)]) == Published(1, 0)
    assert t.entries == 2 * HOLDERS_PER_BLOCK_MAX
    assert t.nodes[names[0]].entries == 1
    got = dict(holders(t, chain(2)))
    assert names[0] not in got
    assert got[names[-1]] == 1
    assert len(got) == HOLDERS_PER_BLOCK_MAX
    # n000 still holds block 1; only block 0 lost a holder.
    from_block_1 = dict(holders(t, [h(1), h(0)]))
    assert len(from_block_1) == HOLDERS_PER_BLOCK_MAX
    assert from_block_1[names[0]] == 1
    assert t.entries == node_entries_total(t)


def test_holder_cap_counts_node_tier_pairs() -> None:
    t = Table()
    half = HOLDERS_PER_BLOCK_MAX // 2
    names = [f"n{i:03d}" for i in range(half + 1)]
    for name in names:
        must_register(t, name)
    for name in names[:-1]:
        must_publish(t, name, chain(2), tier=HOST)
        must_publish(t, name, chain(2), tier=GPU)
    assert t.entries == 2 * HOLDERS_PER_BLOCK_MAX
    must_publish(t, names[-1], chain(2))
    # The oldest (node, tier) pair of each block was n000's HOST copy; its GPU
    # copies stay.
    assert t.entries == 2 * HOLDERS_PER_BLOCK_MAX
    assert t.nodes[names[0]].entries == 2
    assert t.nodes[names[1]].entries == 4
    recs = {node: (k, rows) for node, k, rows in view(t, chain(2), max_nodes=1_000)}
    assert len(recs) == half + 1
    k, rows = recs[names[0]]
    assert k == 2
    assert [r[4] for r in rows] == [GPU, GPU]


# -------------------------------------------------------------------- lookup


def test_lookup_longest_contiguous_prefix_per_node() -> None:
    t = Table()
    for name in ("a", "b", "c", "d"):
        must_register(t, name)
    must_publish(t, "a", chain(5))
    must_publish(t, "b", chain(3))
    must_publish(t, "c", chain(4, start=1))  # not block 0: never a match
    must_publish(t, "d", [h(0), h(1), h(3), h(4)])  # gap at block 2
    assert holders(t, chain(5)) == [("a", 5), ("b", 3), ("d", 2)]
    assert holders(t, chain(5, start=1)) == [("a", 4), ("c", 4), ("b", 2), ("d", 1)]


def test_lookup_best_first_then_node_id_order() -> None:
    t = Table()
    for name in ("zed", "b", "a", "c"):
        must_register(t, name)
        must_publish(t, name, chain(2))
    must_publish(t, "zed", [h(2)])
    assert holders(t, chain(3)) == [("zed", 3), ("a", 2), ("b", 2), ("c", 2)]


def test_lookup_exclude_node_and_max_nodes() -> None:
    t = Table()
    for name, n in (("a", 4), ("b", 3), ("c", 2), ("d", 1)):
        must_register(t, name)
        must_publish(t, name, chain(n))
    q = chain(4)
    assert [m.node.node_id for m in t.lookup(NS, q, 8, "b")] == ["a", "c", "d"]
    assert [m.node.node_id for m in t.lookup(NS, q, 2)] == ["a", "b"]
    assert [m.node.node_id for m in t.lookup(NS, q, 2, "a")] == ["b", "c"]
    assert [m.node.node_id for m in t.lookup(NS, q, 8, "unknown")] == ["a", "b", "c", "d"]
    assert [m.node.node_id for m in t.lookup(NS, q, 1)] == ["a"]


def test_lookup_exclude_only_holder_single_holder_path() -> None:
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", chain(3))
    assert t.lookup(NS, chain(3), 8, "a") == []
    assert holders(t, chain(3)) == [("a", 3)]


@pytest.mark.parametrize("first_tier", [GPU, HOST])
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_lookup_gpu_record_preferred_over_host(first_tier: int, n_blocks: int) -> None:
    t = Table()
    must_register(t, "a")
    second_tier = HOST if first_tier == GPU else GPU
    must_publish(
        t, "a", chain(n_blocks), tier=first_tier, addr=1 << 20 if first_tier == GPU else 2 << 20
    )
    must_publish(
        t, "a", chain(n_blocks), tier=second_tier, addr=1 << 20 if second_tier == GPU else 2 << 20
    )
    got = view(t, chain(n_blocks))
    assert len(got) == 1
    node, blocks, rows = got[0]
    assert (node, blocks) == ("a", n_blocks)
    assert [r[4] for r in rows] == [GPU] * n_blocks
    assert [r[0] for r in rows] == [(1 << 20) + i for i in range(n_blocks)]


def test_lookup_mixed_tiers_along_the_prefix() -> None:
    t = two_nodes()
    must_publish(t, "a", [h(0)], tier=HOST)
    must_publish(t, "a", [h(1)], tier=GPU)
    must_publish(t, "a", [h(1)], tier=HOST)
    must_publish(t, "b", [h(0)], tier=GPU)
    got = {n: (k, tuple(r[4] for r in rows)) for n, k, rows in view(t, chain(2))}
    assert got == {"a": (2, (HOST, GPU)), "b": (1, (GPU,))}


def test_lookup_gap_ends_every_prefix() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(5))
    must_publish(t, "b", chain(5))
    q = [h(0), h(1), h(99), h(2)]
    assert holders(t, q) == [("a", 2), ("b", 2)]
    assert holders(t, [h(99), *chain(5)]) == []


def test_lookup_single_block_chain_lists_every_holder() -> None:
    """A one-block chain held by several nodes must not take a single-holder
    fast path (an earlier version reported only the newest holder)."""
    t = two_nodes()
    must_publish(t, "a", [h(0)])
    must_publish(t, "b", [h(0)])
    assert holders(t, [h(0)]) == [("a", 1), ("b", 1)]
    assert holders(t, [h(0)], ns=NS) == holders(t, [h(0), h(1)])
    assert [m.node.node_id for m in t.lookup(NS, [h(0)], 8, "b")] == ["a"]


@pytest.mark.parametrize("exclude", ["", "a", "b", "c"])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_single_holder_fast_path_matches_multi_holder_path(exclude: str, n: int) -> None:
    """The same question answered with every block singly held (fast path) and
    after an extra holder of block 1 (not of block 0) forces the general path."""
    t = Table()
    for name in ("a", "b", "c"):
        must_register(t, name)
    must_publish(t, "a", chain(3), addr=100)
    must_publish(t, "b", chain(2, start=3), addr=200, tier=HOST)
    q = chain(n)
    fast_answer = view(t, q, exclude=exclude)
    must_publish(t, "c", [h(1)], addr=300)
    slow_answer = view(t, q, exclude=exclude)
    assert fast_answer == slow_answer
    expected = (
        []
        if exclude == "a"
        else [("a", min(n, 3), tuple((100 + i, 4096, 7, 1, GPU) for i in range(min(n, 3))))]
    )
    assert fast_answer == expected
    # c is a holder from block 1 on.
    assert holders(t, chain(2, start=1)) == [("a", 2), ("c", 1)]


def wide(i: int, width: int = 32) -> bytes:
    """Hashes that all share their first 8 bytes (zero-padded big-endian ids)."""
    return i.to_bytes(width, "big")


@pytest.mark.parametrize("width", [9, 16, 32])
def test_lookup_wide_hashes_sharing_their_first_8_bytes(width: int) -> None:
    """The run-following fast path must compare whole keys: hashes wider than
    8 bytes that agree on their first 8 bytes are still different blocks."""
    t = Table()
    must_register(t, "a")
    must_publish(t, "a", [wide(i, width) for i in range(3)], addr=10)
    assert view(t, [wide(0, width), wide(5, width), wide(6, width)]) == [
        ("a", 1, ((10, 4096, 7, 1, GPU),))
    ]
    assert holders(t, [wide(0, width), wide(1, width), wide(9, width)]) == [("a", 2)]
    assert holders(t, [wide(i, width) for i in range(3)]) == [("a", 3)]


@pytest.mark.parametrize("width", [1, 8, 9, 32])
def test_lookup_fast_and_general_paths_agree(width: int) -> None:
    """Block 0 singly held (run-following fast path) and then co-held by
    another node (general path): the first node's answer must not change."""
    t = Table()
    for name in ("a", "b", "c"):
        must_register(t, name)
    ids = [0, 1, 2, 3, 4, 5]
    # a holds 0..3 from one batch (consecutive slots), then 5 in another batch;
    # b holds 4 and 2 (a co-holder in the middle of a's run); a also holds 1 in HOST.
    must_publish(t, "a", [wide(i, width) for i in ids[:4]], addr=100)
    must_publish(t, "b", [wide(4, width), wide(2, width)], addr=200)
    must_publish(t, "a", [wide(5, width)], addr=105)
    must_publish(t, "a", [wide(1, width)], addr=300, tier=HOST)
    queries = [
        [wide(i, width) for i in ids],
        [wide(i, width) for i in (0, 1, 2, 3, 5)],
        [wide(i, width) for i in (0, 1, 4)],
        [wide(i, width) for i in (0, 2, 1)],
        [wide(0, width)] * 3,
    ]
    fast = [view(t, q) for q in queries]
    must_publish(t, "c", [wide(0, width)], addr=400)
    general = [[m for m in view(t, q) if m[0] != "c"] for q in queries]
    assert fast == general
    gpu = {i: (100 + i, 4096, 7, 1, GPU) for i in range(4)} | {5: (105, 4096, 7, 1, GPU)}
    assert fast[0] == [("a", 4, tuple(gpu[i] for i in range(4)))]
    assert fast[1] == [("a", 5, tuple(gpu[i] for i in (0, 1, 2, 3, 5)))]
    assert fast[2] == [("a", 2, (gpu[0], gpu[1]))]
    assert fast[3] == [("a", 3, (gpu[0], gpu[2], gpu[1]))]
    assert fast[4] == [("a", 3, (gpu[0],) * 3)]


def test_lookup_after_slot_reuse_and_restore(tmp_path: Path) -> None:
    """Freed slots are reused out of order, so runs of consecutive slots break;
    answers stay right, before and after a snapshot round trip."""
    t = Table()
    must_register(t, "a")
    must_register(t, "b")
    must_publish(t, "b", chain(6, start=100))
    t.apply(Remove("b", 1, NS, GPU, chain(6, start=100)))
    must_publish(t, "a", chain(6), addr=10)  # lands in b's freed slots, reversed
    expected = [("a", 6, tuple((10 + i, 4096, 7, 1, GPU) for i in range(6)))]
    assert view(t, chain(6)) == expected
    assert view(t, [*chain(3), h(77), *chain(3, start=3)]) == [("a", 3, expected[0][2][:3])]
    back = restored(t, tmp_path / "snap")
    assert view(back, chain(6)) == expected
    must_publish(back, "b", chain(2, start=3), addr=50)
    assert view(back, chain(6)) == expected


# --------------------------------------------------------- records and slots


def test_records_columns() -> None:
    t = Table()
    must_register(t, "a")
    t.apply(
        Publish("a", 1, NS, HOST, chain(2), [2**64 - 1, 5], [2**32 - 1, 6], [0, 8], [2**64 - 1, 0])
    )
    (m,) = t.lookup(NS, chain(2), 8)
    r = t.records(m.slots)
    assert r.addresses == (2**64 - 1, 5)
    assert r.lengths == (2**32 - 1, 6)
    assert r.rkeys == (0, 8)
    assert r.generations == (2**64 - 1, 0)
    assert r.tiers == (HOST, HOST)
    one = t.records(m.slots[:1])
    assert (one.addresses, one.lengths, one.rkeys, one.generations, one.tiers) == (
        (2**64 - 1,),
        (2**32 - 1,),
        (0,),
        (2**64 - 1,),
        (HOST,),
    )


def test_packed_records_match_records() -> None:
    t = two_nodes()
    t.apply(
        Publish(
            "a",
            1,
            NS,
            HOST,
            chain(3),
            [2**64 - 1, 5, 6],
            [2**32 - 1, 6, 7],
            [0, 8, 9],
            [2**64 - 1, 0, 3],
        )
    )
    must_publish(t, "a", [h(1)], tier=GPU, addr=77)
    must_publish(t, "b", chain(2))
    for m in t.lookup(NS, chain(3), 8):
        r = t.records(m.slots)
        p = t.packed_records(m.slots)
        k = len(m.slots)
        assert p.addresses == struct.pack(f"<{k}Q", *r.addresses)
        assert p.lengths == struct.pack(f"<{k}I", *r.lengths)
        assert p.rkeys == struct.pack(f"<{k}I", *r.rkeys)
        assert p.generations == struct.pack(f"<{k}Q", *r.generations)
        assert p.tiers == bytes(r.tiers)
    (a,) = [m for m in t.lookup(NS, chain(3), 8) if m.node.node_id == "a"]
    assert t.records(a.slots).tiers == (HOST, GPU, HOST)
    assert t.records(a.slots).addresses == (2**64 - 1, 77, 6)


def test_slots_are_reused_after_free() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(10), tier=GPU, gen=3, addr=100)
    assert t.apply(Remove("a", 1, NS, GPU, chain(5))) == Removed(5)
    assert t.entries == t.nodes["a"].entries == 5
    high_water = len(t.col)
    # New entries (other node, other tier) land in the freed slots.
    must_publish(t, "b", chain(5), tier=HOST, gen=0, addr=500)
    assert len(t.col) == high_water
    assert t.entries == 10
    assert (t.nodes["a"].entries, t.nodes["b"].entries) == (5, 5)
    assert view(t, chain(5)) == [("b", 5, tuple((500 + i, 4096, 7, 0, HOST) for i in range(5)))]
    assert holders(t, chain(5, start=5)) == [("a", 5)]
    # Clearing one node through its own list frees exactly its slots.
    assert t.apply(ClearNode("b", 1, None, False)) == Removed(5)
    assert t.entries == 5
    assert t.block_count == 5
    must_publish(t, "b", chain(3, start=20))
    assert len(t.col) == high_water
    assert t.entries == node_entries_total(t) == 8


def test_node_index_reuse_after_deregister() -> None:
    t = two_nodes()
    must_publish(t, "a", chain(2))
    must_publish(t, "b", chain(3))
    assert t.apply(ClearNode("a", 1, None, True)) == Removed(2)
    must_register(t, "c")
    must_publish(t, "c", chain(1))
    assert holders(t, chain(3)) == [("b", 3), ("c", 1)]
    assert t.apply(ClearNode("b", 1, None, False)) == Removed(3)
    assert holders(t, chain(3)) == [("c", 1)]
    assert t.entries == node_entries_total(t) == 1


def test_apply_is_deterministic_across_tables() -> None:
    cmds: list[Command] = [
        publish_cmd("a", chain(4)),
        publish_cmd("b", chain(2), tier=HOST),
        Remove("a", 1, NS, GPU, [h(1)]),
        publish_cmd("a", chain(4), gen=2),
        ClearNode("b", 1, NS, False),
        ExpireNodes(5_000, (("a", 1),)),
    ]
    results = []
    for _ in range(2):
        t = two_nodes()
        results.append([t.apply(c) for c in cmds])
    assert results[0] == results[1]
    assert results[0][-1] == Expired(("a",), 4)
