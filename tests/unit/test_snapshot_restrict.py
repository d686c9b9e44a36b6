"""`snapshot.restrict`: a captured table narrowed to some namespaces.

The narrowed snapshot must load into the table that applying only those
namespaces' commands (and every node-wide one) builds: same digest, same
lookups, records included, and the same results for every command applied
after it. The logs are seeded and random over four namespaces and four
nodes, with shared blocks (several holders, two tiers of one node), removes
and clears that free slots and publishes that reuse them, re-registrations
with a higher incarnation, deregistrations and lease expiry. The loaded
table's layout (node lists, chains, counts, flags) is checked slot by slot.
"""

from __future__ import annotations

import io
import random
from collections.abc import Collection

import pytest

from kvdir.directory import snapshot
from kvdir.directory.commands import (
    ClearNode,
    Command,
    ExpireNodes,
    Heartbeat,
    Publish,
    RegisterNode,
    Remove,
    Tier,
)
from kvdir.directory.table import NIL, Table
from kvdir.directory.watch import namespace_of

from .helpers import view

NAMESPACES = tuple(f"m{i}\x1fbf16\x1f16\x1fnhd\x1f0/1" for i in range(4))
NODES = ("node-a", "node-b", "node-c", "node-d")
HASHES = tuple(i.to_bytes(8, "big") for i in range(40))
CHAINS = [list(HASHES[i : i + 12]) for i in range(0, 40, 4)]
SEEDS = range(12)
LOG = 400
WATCHED = [
    {NAMESPACES[0]},
    {NAMESPACES[1], NAMESPACES[3]},
    set(NAMESPACES),
    {"never-published"},
    set(),
]


class Log:
    """A seeded log of commands; every node acts with its current incarnation."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.inc = dict.fromkeys(NODES, 0)
        self.now = 1_000
        self.gen = 0

    def commands(self, n: int) -> list[Command]:
        return [self.one() for _ in range(n)]

    def one(self) -> Command:
        rng, node = self.rng, self.rng.choice(NODES)
        self.now += rng.randint(0, 50)
        roll = rng.random()
        if roll < 0.08 or self.inc[node] == 0:
            self.inc[node] += 1  # a (re)start: a higher incarnation drops every entry
            return RegisterNode(node, "h", "h:1", ("tcp",), self.inc[node], 500, self.now)
        inc, ns = self.inc[node], rng.choice(NAMESPACES)
        tier = int(rng.choice((Tier.GPU, Tier.GPU, Tier.HOST)))
        start = rng.randrange(len(HASHES))
        hs = list(HASHES[start : start + rng.randint(1, 10)])
        if roll < 0.55:
            self.gen += 1
            n = len(hs)
            addrs = [rng.randrange(1 << 40) for _ in hs]
            return Publish(node, inc, ns, tier, hs, addrs, [4096] * n, [9] * n, [self.gen] * n)
        if roll < 0.80:
            return Remove(node, inc, ns, tier, hs)
        if roll < 0.86:
            return ClearNode(node, inc, rng.choice((None, ns)), False)
        if roll < 0.88:
            return ClearNode(node, inc, rng.choice((None, ns)), True)
        if roll < 0.95:
            return Heartbeat(node, inc, self.now)
        return ExpireNodes(self.now, tuple((n, self.inc[n]) for n in NODES if rng.random() < 0.3))


def watched(cmd: Command, namespaces: Collection[str]) -> bool:
    """Whether a stream filtered to `namespaces` carries `cmd` (the Watch service's rule)."""
    ns = namespace_of(cmd)
    return ns is None or ns in namespaces


def reloaded(image: snapshot.Image) -> tuple[Table, bytes]:
    buf = io.BytesIO()
    snapshot.write_to(buf, image, {}, [])
    data = buf.getvalue()
    table, _, _ = snapshot.load(io.BytesIO(data))
    return table, data


def check_layout(t: Table) -> None:
    """Every slot used, once on its node's list, on its block's chain, flags right."""
    c = t.col
    assert t.free == NIL
    seen: set[int] = set()
    for idx, node in enumerate(t.node_by_idx):
        if node is None:
            continue
        s, prev, count = node.head, NIL, 0
        while s != NIL:
            assert c.node[s] == idx and c.nprev[s] == prev and s not in seen
            seen.add(s)
            prev, s, count = s, c.nnext[s], count + 1
        assert count == node.entries
    assert seen == set(range(len(c))) and t.entries == len(c)
    for ns, blocks in enumerate(t.blocks):
        for key, head in blocks.items():
            s, holders = head, []
            while s != NIL:
                assert c.key[s] == key and c.ns[s] == ns
                holders.append(s)
                s = c.bnext[s]
            assert [c.solo[s] for s in holders] == [int(len(holders) == 1)] * len(holders)
            for s in holders:
                twins = sum(c.node[o] == c.node[s] for o in holders)
                assert c.dual[s] == int(twins > 1)


def check_layout_after_applies(t: Table) -> None:
    """Node lists and entry counts still agree once slots were freed and reused."""
    c = t.col
    for node in t.nodes.values():
        s, count = node.head, 0
        while s != NIL:
            assert c.node[s] == t.node_idx[node.node_id]
            s, count = c.nnext[s], count + 1
        assert count == node.entries
    assert t.entries == sum(n.entries for n in t.nodes.values())


def same_tables(got: Table, want: Table) -> None:
    assert got.digest() == want.digest()
    assert got.ns_names == want.ns_names
    for ns in NAMESPACES:
        for hs in CHAINS:
            assert view(got, hs, ns=ns) == view(want, hs, ns=ns)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", SEEDS)
def test_restricted_snapshot_is_the_table_of_the_filtered_log(seed: int) -> None:
    log = Log(seed)
    before, after = log.commands(LOG), log.commands(LOG // 2)
    full = Table()
    reused = False
    for cmd in before:
        had_free, entries = full.free != NIL, full.entries
        full.apply(cmd)
        reused |= had_free and isinstance(cmd, Publish) and full.entries > entries
    assert reused, "no freed slot was reused: the test would miss out-of-order node lists"
    image = snapshot.capture(full)
    for namespaces in WATCHED:
        want = Table()
        for cmd in before:
            if watched(cmd, namespaces):
                want.apply(cmd)
        got, _ = reloaded(snapshot.restrict(image, namespaces))
        check_layout(got)
        same_tables(got, want)
        for cmd in after:  # the filtered stream after the snapshot
            if watched(cmd, namespaces):
                assert got.apply(cmd) == want.apply(cmd), cmd
        check_layout_after_applies(got)
        same_tables(got, want)


def test_other_namespaces_leave_nothing_but_nodes() -> None:
    full = Table()
    for cmd in Log(99).commands(LOG):
        full.apply(cmd)
    assert full.free != NIL, "no free slot to drop"
    got, data = reloaded(snapshot.restrict(snapshot.capture(full), {NAMESPACES[2]}))
    ns2 = full.ns_ids[NAMESPACES[2]]
    ns2_entries = sum(1 for s in range(len(full.col)) if full.col.ns[s] == ns2 and full.col.key[s])
    assert 0 < got.entries == ns2_entries < full.entries
    assert got.ns_names == [NAMESPACES[2]] and got.block_count == len(full.blocks[ns2])
    assert set(got.nodes) == set(full.nodes)
    _, whole = reloaded(snapshot.capture(full))
    assert len(data) < len(whole)


def test_the_captured_image_is_left_as_it_was() -> None:
    full = Table()
    for cmd in Log(7).commands(LOG):
        full.apply(cmd)
    image = snapshot.capture(full)
    _, before = reloaded(image)
    snapshot.restrict(image, {NAMESPACES[0]})
    _, after = reloaded(image)
    assert after == before


def test_an_empty_table_and_one_with_only_nodes() -> None:
    empty, _ = reloaded(snapshot.restrict(snapshot.capture(Table()), {NAMESPACES[0]}))
    assert empty.digest() == Table().digest()
    nodes = Table()
    nodes.apply(RegisterNode("n", "h", "h:1", (), 1, 500, 0))
    nodes.apply(RegisterNode("gone", "h", "h:1", (), 1, 500, 0))
    nodes.apply(ClearNode("gone", 1, None, True))  # leaves a free node index
    got, _ = reloaded(snapshot.restrict(snapshot.capture(nodes), set()))
    assert got.digest() == nodes.digest() and got.free_node_idx == nodes.free_node_idx
