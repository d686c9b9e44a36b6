"""A frozen capture is the table as it was at the freeze, however the table changed since.

`snapshot.freeze` runs on the Raft thread in O(nodes); the columns are copied
later, on another thread, while the table keeps applying (copy-on-write:
`Table._keep` saves a slot's row before it first changes). A missed `_keep`
would make a snapshot mix two table states, so these tests drive every kind of
change (fresh and slow-path publishes, republishes that move a block between
tiers, removes, clears, expiries, free-slot reuse, holder eviction) with
several captures open at once, and compare each capture's copy, made late,
with an eager copy made at the freeze.
"""

from __future__ import annotations

import io
import random
import sys
import threading
import weakref

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
from kvdir.directory.table import Table

NODES = [f"n{i}" for i in range(5)]
NAMESPACES = ["a", "b", "c"]
TIERS = [int(Tier.GPU), int(Tier.HOST)]


def _flat(image: snapshot.Image) -> tuple[object, ...]:
    return ([a.tobytes() for a in image.arrays], image.keys, image.heads, image.meta)


def _hashes(rng: random.Random, n: int) -> list[bytes]:
    # A small key space, so publishes hit existing blocks and chains grow.
    return [bytes([rng.randrange(4)]) * 3 + rng.randrange(40).to_bytes(2, "big") for _ in range(n)]


def _command(rng: random.Random, now_ms: int, inc: dict[str, int]) -> Command:
    node = rng.choice(NODES)
    roll = rng.random()
    if roll < 0.03:
        inc[node] += rng.choice((0, 1))  # a restart drops the node's entries
        return RegisterNode(node, "h", "e", ("tcp",), inc[node], 500, now_ms)
    if roll < 0.06:
        return ClearNode(node, inc[node], rng.choice((None, *NAMESPACES)), rng.random() < 0.2)
    if roll < 0.08:
        return ExpireNodes(now_ms, tuple((n, inc[n]) for n in NODES))
    if roll < 0.15:
        return Heartbeat(node, inc[node], now_ms)
    ns, tier = rng.choice(NAMESPACES), rng.choice(TIERS)
    if roll < 0.35:
        hs = _hashes(rng, rng.randint(1, 8))
        return Remove(node, inc[node], ns, tier, hs)
    if roll < 0.45:  # fresh blocks: the bulk path
        hs = [rng.randbytes(8) for _ in range(rng.randint(2, 20))]
    else:
        hs = _hashes(rng, rng.randint(1, 12))
    n = len(hs)
    addrs = [rng.randrange(1 << 40) for _ in range(n)]
    gens = [rng.randrange(1, 5) for _ in range(n)]
    return Publish(node, inc[node], ns, tier, hs, addrs, [4096] * n, [7] * n, gens)


def _heads_of_indexes(t: Table) -> list[list[int]]:
    return [sorted(b.values()) for b in t.blocks]


@pytest.mark.parametrize("seed", range(12))
def test_late_copies_equal_the_table_at_each_freeze(seed: int) -> None:
    rng = random.Random(seed)
    t = Table()
    inc = dict.fromkeys(NODES, 1)
    for n in NODES:
        t.apply(RegisterNode(n, "h", "e", ("tcp",), 1, 500, 0))
    open_: list[tuple[snapshot.Frozen, tuple[object, ...], int]] = []
    checked = 0
    for step in range(1500):
        t.apply(_command(rng, step * 7, inc))
        if rng.random() < 0.03 and len(open_) < 3:
            want = snapshot.capture(t)  # an eager copy, on this thread, at the same point
            heads = [h.tolist() for h in want.heads]
            assert heads == _heads_of_indexes(t), "heads derived from the columns"
            open_.append((snapshot.freeze(t), _flat(want), step))
        if open_ and rng.random() < 0.02:
            frozen, want_flat, at = open_.pop(rng.randrange(len(open_)))
            assert _flat(frozen.image()) == want_flat, f"seed {seed}: capture of step {at}"
            assert frozen.image() is frozen.image()  # copied once
            checked += 1
    for frozen, want_flat, at in open_:
        assert _flat(frozen.image()) == want_flat, f"seed {seed}: capture of step {at}"
        checked += 1
    assert checked > 0
    assert t.frozen == (), "every copy ended its copy-on-write"


class _Applier:
    """A table with every node registered (10 s leases), fed seeded commands."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.table = Table()
        self.inc = dict.fromkeys(NODES, 1)
        for n in NODES:
            self.table.apply(RegisterNode(n, "h", "e", ("tcp",), 1, 10_000, 0))

    def steps(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            self.table.apply(_command(self.rng, step, self.inc))


def test_a_restored_capture_has_the_same_digest_and_lookups() -> None:
    feed = _Applier(7)
    t = feed.table
    feed.steps(0, 400)
    frozen, digest = snapshot.freeze(t), t.digest()
    chains = {ns: [k for k in t.col.key if k is not None][:50] for ns in NAMESPACES}
    want = {
        ns: [(m.node.node_id, m.prefix_blocks) for m in t.lookup(ns, c, 8)]
        for ns, c in chains.items()
    }
    feed.steps(400, 800)
    buf = io.BytesIO()
    snapshot.write_to(buf, frozen.image(), {}, [])
    back, _, _ = snapshot.load(io.BytesIO(buf.getvalue()))
    assert back.digest() == digest
    got = {
        ns: [(m.node.node_id, m.prefix_blocks) for m in back.lookup(ns, c, 8)]
        for ns, c in chains.items()
    }
    assert got == want


@pytest.mark.parametrize("seed", range(4))
def test_a_table_over_a_capture_digests_as_the_table_did_at_the_freeze(seed: int) -> None:
    """ClusterStatus(with_digest) digests `table_of(capture)` off the Raft thread: it must
    equal the live table's digest at the freeze, whatever was applied after it."""
    feed = _Applier(seed)
    t = feed.table
    feed.steps(0, 300)
    frozen, digest = snapshot.freeze(t), t.digest()
    feed.steps(300, 600)
    assert t.digest() != digest, "the later applies changed the table"
    image = frozen.image()
    assert snapshot.table_of(image).digest() == digest
    assert snapshot.table_of(snapshot.capture(t)).digest() == t.digest()


def test_an_abandoned_capture_ends_its_copy_on_write() -> None:
    t = Table()
    t.apply(RegisterNode("n0", "h", "e", ("tcp",), 1, 500, 0))
    frozen = snapshot.freeze(t)
    assert len(t.frozen) == 1
    gone = weakref.ref(frozen)
    del frozen  # e.g. a Watch whose opening failed after the capture
    assert gone() is None
    assert not t.frozen


def test_copy_on_another_thread_while_the_table_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy runs with applies interleaved at a very short GIL switch interval."""
    rng = random.Random(99)
    t = Table()
    inc = dict.fromkeys(NODES, 1)
    for n in NODES:
        t.apply(RegisterNode(n, "h", "e", ("tcp",), 1, 1 << 40, 0))
    for step in range(2000):
        t.apply(_command(rng, step, inc))
        if step % 20 == 0:  # bulk, so the copy takes many chunks
            hs = [rng.randbytes(8) for _ in range(500)]
            t.apply(
                Publish(
                    NODES[0],
                    inc[NODES[0]],
                    "a",
                    TIERS[0],
                    hs,
                    [1] * 500,
                    [2] * 500,
                    [3] * 500,
                    [1] * 500,
                )
            )
    assert len(t.col) > 5_000
    monkeypatch.setattr(snapshot, "COPY_CHUNK_SLOTS", 256)
    old = sys.getswitchinterval()
    mismatches = 0
    try:
        sys.setswitchinterval(1e-6)
        for _ in range(5):
            want = _flat(snapshot.capture(t))
            frozen = snapshot.freeze(t)
            copier = threading.Thread(target=frozen.image)
            copier.start()
            applied = 0
            while copier.is_alive() or applied < 50:
                t.apply(_command(rng, 5000 + applied, inc))
                applied += 1
            copier.join(timeout=60)
            assert not copier.is_alive(), "the copy finished"
            mismatches += _flat(frozen.image()) != want  # the copy the thread made
    finally:
        sys.setswitchinterval(old)
    assert mismatches == 0
    assert t.frozen == ()


def test_drop_empties_only_the_copy() -> None:
    t = Table()
    t.apply(RegisterNode("n0", "h", "e", ("tcp",), 1, 500, 0))
    hs = [i.to_bytes(8, "big") for i in range(1000)]
    t.apply(Publish("n0", 1, "a", TIERS[0], hs, [1] * 1000, [2] * 1000, [3] * 1000, [1] * 1000))
    image = snapshot.capture(t)
    snapshot.drop(image)
    assert image.keys == [] and t.col.key == hs
