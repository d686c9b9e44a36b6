"""`Table` against a plain dict-of-dicts reference model, over random commands.

After every step the table and the model must give the same result for the
command, the same lookups (records included), the same node information and
entry counts. Snapshots (capture, write to a file, read) taken at random points
must answer identically (and be byte-for-byte the state of a twin table that
never went through a snapshot), and the run continues on the restored table,
so its free lists and node lists are exercised too.

Commands are generated from fixed strategies with placeholders (the node's
current incarnation, the stored generation or address, a hash the node holds)
that are resolved against the model when the step runs, so that most commands
apply and the boundaries (equal generation, stale one, guarded remove) come up.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdir.directory import snapshot
from kvdir.directory import table as table_mod
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
    RegisterNode,
    Reject,
    Rejected,
    Remove,
    Removed,
    Renewed,
    Result,
)
from kvdir.directory.limits import HOLDERS_PER_BLOCK_MAX
from kvdir.directory.table import Table

from .helpers import View, view

NODES = ("a", "b", "c", "d")
NAMESPACES = ("n1", "n2")
WIDE = tuple(b"\x03" * 8 + bytes([i]) * 24 for i in range(3))
"""32-byte hashes that share their first 8 bytes."""
HASHES = (
    (0).to_bytes(8, "big"),
    (1).to_bytes(8, "big"),
    (2).to_bytes(8, "big"),
    *WIDE,
    b"\x04",
    (5).to_bytes(8, "big"),
)
NEVER = b"\xee" * 8
CHAINS: list[list[bytes]] = [
    list(HASHES),
    list(reversed(HASHES)),
    list(HASHES[:3]),
    [HASHES[0], HASHES[1], NEVER, HASHES[2]],
    [HASHES[0], HASHES[2], HASHES[1]],
    [HASHES[2], HASHES[1], HASHES[0], HASHES[-1]],
    list(WIDE),
    [WIDE[0], WIDE[2], WIDE[1]],
    [WIDE[1], WIDE[2]],
    [HASHES[-2], HASHES[-1], HASHES[0]],
    *([x, HASHES[0]] for x in HASHES[1:]),
    *([x] for x in HASHES),
]
CLOCK_SAMPLES = (0, 999, 1_000, 3_000, 4_500, 10_000)


# --------------------------------------------------------------------- model


@dataclass
class MNode:
    incarnation: int
    lease_ms: int
    expiry: int
    host: str
    endpoint: str
    transports: tuple[str, ...]


@dataclass(frozen=True)
class MRec:
    node: str
    tier: int
    row: tuple[int, int, int, int, int]
    """(address, length, rkey, generation, tier)."""

    @property
    def gen(self) -> int:
        return self.row[3]


class Model:
    """The directory's semantics, written as plainly as possible.

    Holders of a block are a list, oldest first; an update keeps its place.
    `ClearNode(deregister=True)` forgets the node and drops all its entries
    (whatever the namespace: a forgotten node can hold nothing).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.nodes: dict[str, MNode] = {}
        self.blocks: dict[str, dict[bytes, list[MRec]]] = {}

    def _check(self, node_id: str, incarnation: int) -> MNode | Rejected:
        node = self.nodes.get(node_id)
        if node is None:
            return Rejected(Reject.UNKNOWN_NODE, "")
        if node.incarnation != incarnation:
            return Rejected(Reject.STALE_INCARNATION, "")
        return node

    def _drop(self, node_id: str, namespace: str | None) -> int:
        removed = 0
        for ns, blocks in self.blocks.items():
            if namespace is not None and ns != namespace:
                continue
            for key in list(blocks):
                keep = [r for r in blocks[key] if r.node != node_id]
                removed += len(blocks[key]) - len(keep)
                if keep:
                    blocks[key] = keep
                else:
                    del blocks[key]
        return removed

    def apply(self, cmd: Command) -> Result:
        match cmd:
            case RegisterNode():
                return self._register(cmd)
            case Heartbeat():
                node = self._check(cmd.node_id, cmd.incarnation)
                if isinstance(node, Rejected):
                    return node
                node.expiry = max(node.expiry, cmd.now_ms + node.lease_ms)
                return Renewed(node.expiry)
            case Publish():
                return self._publish(cmd)
            case Remove():
                return self._remove(cmd)
            case ClearNode():
                node = self._check(cmd.node_id, cmd.incarnation)
                if isinstance(node, Rejected):
                    return node
                namespace = None if cmd.deregister else cmd.namespace
                removed = self._drop(cmd.node_id, namespace)
                if cmd.deregister:
                    del self.nodes[cmd.node_id]
                return Removed(removed)
            case ExpireNodes():
                gone: list[str] = []
                removed = 0
                for node_id, incarnation in cmd.nodes:
                    n = self.nodes.get(node_id)
                    if n is None or n.incarnation != incarnation or n.expiry > cmd.now_ms:
                        continue
                    removed += self._drop(node_id, None)
                    del self.nodes[node_id]
                    gone.append(node_id)
                return Expired(tuple(gone), removed)
            case Barrier():
                return Done()
            case _:  # the shard map and moves: test_shard_view.py, test_shard_moves.py
                raise NotImplementedError(f"the model has no {type(cmd).__name__}")

    def _register(self, cmd: RegisterNode) -> Result:
        node = self.nodes.get(cmd.node_id)
        replaced = False
        if node is not None and cmd.incarnation < node.incarnation:
            return Rejected(Reject.STALE_INCARNATION, "")
        if node is not None and cmd.incarnation > node.incarnation:
            self._drop(cmd.node_id, None)
            replaced = True
        expiry = cmd.now_ms + cmd.lease_ms
        if node is None:
            node = self.nodes[cmd.node_id] = MNode(
                cmd.incarnation, cmd.lease_ms, expiry, cmd.host, cmd.endpoint, cmd.transports
            )
        node.incarnation, node.lease_ms = cmd.incarnation, cmd.lease_ms
        node.host, node.endpoint, node.transports = cmd.host, cmd.endpoint, cmd.transports
        node.expiry = max(node.expiry, expiry)
        return Registered(node.expiry, node.lease_ms, replaced)

    def _publish(self, cmd: Publish) -> Result:
        node = self._check(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        if cmd.tier not in (1, 2):
            return Rejected(Reject.BAD_TIER, "")
        n = len(cmd.hashes)
        if any(len(col) != n for col in (cmd.addresses, cmd.lengths, cmd.rkeys, cmd.generations)):
            return Rejected(Reject.BAD_BATCH, "")
        blocks = self.blocks.setdefault(cmd.namespace, {})
        applied = stale = 0
        for i, key in enumerate(cmd.hashes):
            holders = blocks.setdefault(key, [])
            rec = MRec(
                cmd.node_id,
                cmd.tier,
                (cmd.addresses[i], cmd.lengths[i], cmd.rkeys[i], cmd.generations[i], cmd.tier),
            )
            pos = next(
                (j for j, r in enumerate(holders) if (r.node, r.tier) == (cmd.node_id, cmd.tier)),
                None,
            )
            if pos is not None:
                # Generations order the publishes of one slot (address); a record
                # at another address means the block moved: newer, whatever its
                # generation.
                if rec.gen < holders[pos].gen and rec.row[0] == holders[pos].row[0]:
                    stale += 1
                    continue
                holders[pos] = rec
            else:
                if len(holders) >= self.cap:
                    del holders[0]
                holders.append(rec)
            applied += 1
        return Published(applied, stale)

    def _remove(self, cmd: Remove) -> Result:
        node = self._check(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        n = len(cmd.hashes)
        if any(col and len(col) != n for col in (cmd.generations, cmd.addresses)):
            return Rejected(Reject.BAD_BATCH, "")
        blocks = self.blocks.get(cmd.namespace, {})
        removed = 0
        for i, key in enumerate(cmd.hashes):
            holders = blocks.get(key, [])
            pos = next(
                (j for j, r in enumerate(holders) if (r.node, r.tier) == (cmd.node_id, cmd.tier)),
                None,
            )
            if pos is None:
                continue
            if cmd.generations and holders[pos].gen > cmd.generations[i]:
                continue
            if cmd.addresses and holders[pos].row[0] != cmd.addresses[i]:
                continue
            del holders[pos]
            if not holders:
                del blocks[key]
            removed += 1
        return Removed(removed)

    # reads

    def lookup(self, namespace: str, chain: list[bytes], max_nodes: int, exclude: str = "") -> View:
        blocks = self.blocks.get(namespace, {})
        if not chain or max_nodes <= 0:
            return []
        out: View = []
        for node_id in {r.node for r in blocks.get(chain[0], [])} - {exclude}:
            rows = []
            for key in chain:
                mine = [r for r in blocks.get(key, []) if r.node == node_id]
                if not mine:
                    break
                rows.append(min(mine, key=lambda r: r.tier).row)
            out.append((node_id, len(rows), tuple(rows)))
        out.sort(key=lambda m: (-m[1], m[0]))
        return out[:max_nodes]

    def entries_of(self, node_id: str) -> int:
        return sum(
            1 for b in self.blocks.values() for hs in b.values() for r in hs if r.node == node_id
        )

    def expired_nodes(self, now_ms: int, limit: int, grace_from_ms: int) -> list[tuple[str, int]]:
        """A lease counts as renewed at `grace_from_ms` (a new leader's start)."""
        out = sorted(
            (k, n.incarnation)
            for k, n in self.nodes.items()
            if max(n.expiry, grace_from_ms + n.lease_ms) <= now_ms
        )
        return out[:limit]


# ------------------------------------------------------------ observations


def norm(res: Result) -> object:
    """Results compare without the human-readable rejection message."""
    return ("rejected", res.reason) if isinstance(res, Rejected) else res


Combo = tuple[str, int, str, int]
"""A lookup to compare: (namespace, index into CHAINS, exclude node, max nodes)."""

ALL_LOOKUPS: list[Combo] = [
    (ns, i, ex, mx)
    for ns in NAMESPACES
    for i in range(len(CHAINS))
    for ex, mx in (("", 64), ("", 2), (NODES[i % len(NODES)], 64))
]
CORE_LOOKUPS: list[Combo] = [(ns, i, "", 64) for ns in NAMESPACES for i in (0, 1, 6)]
EXPIRY_SAMPLES = [
    (now, lim, grace) for now in CLOCK_SAMPLES for lim in (1, 10) for grace in (0, 2_000)
]


def lookups_at(step: int) -> list[Combo]:
    """Numpy lookups cost ~150 us each: after a step compare the core ones and
    a rotating thirtieth of the rest; `ALL_LOOKUPS` are compared at the end."""
    return CORE_LOOKUPS + ALL_LOOKUPS[step % 30 :: 30]


def observe_table(t: Table, combos: list[Combo]) -> dict[str, Any]:
    return {
        "nodes": {
            k: (
                n.incarnation,
                n.lease_ms,
                n.lease_expiry_ms,
                n.host,
                n.endpoint,
                n.transports,
                n.entries,
            )
            for k, n in t.nodes.items()
        },
        "entries": t.entries,
        "blocks": t.block_count,
        "expired": [t.expired_nodes(now, lim, grace) for now, lim, grace in EXPIRY_SAMPLES],
        "lookups": [
            (ns, i, ex, mx, view(t, CHAINS[i], ns=ns, max_nodes=mx, exclude=ex))
            for ns, i, ex, mx in combos
        ],
    }


def observe_model(m: Model, combos: list[Combo]) -> dict[str, Any]:
    return {
        "nodes": {
            k: (
                n.incarnation,
                n.lease_ms,
                n.expiry,
                n.host,
                n.endpoint,
                n.transports,
                m.entries_of(k),
            )
            for k, n in m.nodes.items()
        },
        "entries": sum(m.entries_of(k) for k in m.nodes),
        "blocks": sum(len(b) for b in m.blocks.values()),
        "expired": [m.expired_nodes(now, lim, grace) for now, lim, grace in EXPIRY_SAMPLES],
        "lookups": [(ns, i, ex, mx, m.lookup(ns, CHAINS[i], mx, ex)) for ns, i, ex, mx in combos],
    }


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    for key in ("nodes", "entries", "blocks", "expired"):
        assert got[key] == want[key], f"{where}: {key} differ"
    for g, w in zip(got["lookups"], want["lookups"], strict=True):
        ns, i, ex, mx, _ = w
        assert g == w, f"{where}: lookup ns={ns} chain={CHAINS[i]} exclude={ex!r} max={mx}"


# -------------------------------------------------------------- strategies


class Snap:
    """Pseudo-step: snapshot to a file, read it back, continue on the copy."""

    def __repr__(self) -> str:
        return "Snap()"


class Capture:
    """Pseudo-step: capture an image now, write and check it at the very end."""

    def __repr__(self) -> str:
        return "Capture()"


Step = Command | Snap | Capture

# Strategies are built once (building them per step costs more than the test):
# a generated command's incarnation may be a placeholder, resolved against the
# model when the step runs, so that most commands carry the node's current
# incarnation and the rest a stale or a newer one.
CUR, PREV, NEXT = -1, -2, -3

node_ids = st.sampled_from(NODES)
incarnations = st.sampled_from([CUR] * 6 + [PREV, NEXT])
clock = st.integers(0, 12).map(lambda x: x * 500)
small = st.integers(0, 3)
any_hashes = st.lists(st.sampled_from(HASHES), max_size=6)
columns = {n: st.lists(small, min_size=n, max_size=n) for n in range(7)}
# A generation may also be a placeholder for the stored one (or one older), so
# the equal and stale boundaries of publish and remove come up often.
SAME, OLDER = -1, -2
HELD = tuple(f"held:{i}".encode() for i in range(3))
"""Remove placeholders for the i-th hash the node holds in that namespace and tier."""


def _placeholder_lists(values: list[int]) -> dict[int, st.SearchStrategy[list[int]]]:
    return {n: st.lists(st.sampled_from(values), min_size=n, max_size=n) for n in range(7)}


generations = _placeholder_lists([0, 1, 2, 3, SAME, SAME, OLDER, OLDER])
addresses = _placeholder_lists([0, 1, 2, SAME, SAME, SAME])
guard_generations = _placeholder_lists([0, 3, SAME, SAME, SAME, OLDER])
guard_addresses = _placeholder_lists([0, 1, SAME, SAME, SAME, SAME])


def resolve(cmd: Step, m: Model) -> Step:
    def inc(node_id: str, code: int) -> int:
        if code >= 0:
            return code
        node = m.nodes.get(node_id)
        if node is None:
            return {CUR: 1, PREV: 2, NEXT: 3}[code]
        return node.incarnation + {CUR: 0, PREV: -1, NEXT: 1}[code]

    def stored(c: Publish | Remove, column: list[int], field: int) -> list[int]:
        """`column` with placeholders replaced by the stored record's `row[field]`."""
        out = []
        for key, code in zip(c.hashes, column, strict=False):
            value = code
            if code < 0:
                holders = m.blocks.get(c.namespace, {}).get(key, [])
                mine = [r.row[field] for r in holders if (r.node, r.tier) == (c.node_id, c.tier)]
                value = max(0, mine[0] - (code == OLDER)) if mine else 0
            out.append(value)
        return out + column[len(c.hashes) :]

    def held(c: Remove) -> list[bytes]:
        blocks = m.blocks.get(c.namespace, {})
        mine = sorted(
            k
            for k, holders in blocks.items()
            if any((r.node, r.tier) == (c.node_id, c.tier) for r in holders)
        )
        return [
            (mine[HELD.index(k) % len(mine)] if mine else NEVER) if k in HELD else k
            for k in c.hashes
        ]

    if isinstance(cmd, Remove):
        cmd = dataclasses.replace(cmd, hashes=held(cmd))
    match cmd:
        case Publish() | Remove():
            return dataclasses.replace(
                cmd,
                incarnation=inc(cmd.node_id, cmd.incarnation),
                generations=stored(cmd, cmd.generations, 3),
                addresses=stored(cmd, cmd.addresses, 0),
            )
        case RegisterNode() | Heartbeat() | ClearNode():
            return dataclasses.replace(cmd, incarnation=inc(cmd.node_id, cmd.incarnation))
        case ExpireNodes():
            return ExpireNodes(cmd.now_ms, tuple((n, inc(n, i)) for n, i in cmd.nodes))
    return cmd


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    hashes = draw(any_hashes)
    n = len(hashes)
    cols = [draw(addresses[n]), draw(columns[n]), draw(columns[n]), draw(generations[n])]
    if draw(st.integers(0, 15)) == 0:  # a malformed batch, now and then
        col = cols[draw(st.integers(0, 3))]
        if col:
            col.pop()
        else:
            col.append(0)
    tier = draw(st.sampled_from([1, 1, 1, 1, 1, 2, 2, 2, 2, 3]))
    return Publish(
        draw(node_ids), draw(incarnations), draw(st.sampled_from(NAMESPACES)), tier, hashes, *cols
    )


@st.composite
def removes(draw: st.DrawFn) -> Remove:
    hashes = draw(st.lists(st.sampled_from((*HASHES, NEVER, *HELD, *HELD)), max_size=4))
    gens = draw(st.one_of(st.just([]), guard_generations[len(hashes)]))
    addrs = draw(st.one_of(st.just([]), guard_addresses[len(hashes)]))
    namespace = draw(st.sampled_from((*NAMESPACES, "unknown")))
    tier = draw(st.sampled_from([1, 2, 2, 1, 7]))
    return Remove(draw(node_ids), draw(incarnations), namespace, tier, hashes, gens, addrs)


registers = st.builds(
    RegisterNode,
    node_ids,
    st.sampled_from(["h1", "h2"]),
    st.sampled_from(["e1", "e2"]),
    st.sampled_from([(), ("tcp",), ("rdma", "tcp")]),
    incarnations,
    st.sampled_from([500, 1_000, 3_000]),
    clock,
)
heartbeats = st.builds(Heartbeat, node_ids, incarnations, clock)
clears = st.builds(
    ClearNode,
    node_ids,
    incarnations,
    st.sampled_from((None, *NAMESPACES, "unknown")),
    st.sampled_from([False, False, False, True]),
)
expires = st.builds(
    ExpireNodes, clock, st.lists(st.tuples(node_ids, incarnations), max_size=4).map(tuple)
)
any_step: st.SearchStrategy[Step] = st.one_of(
    registers,
    registers,
    heartbeats,
    publishes(),
    publishes(),
    publishes(),
    publishes(),
    removes(),
    removes(),
    removes(),
    clears,
    expires,
    st.just(Barrier()),
    st.builds(Snap),
    st.builds(Capture),
)
busy_step: st.SearchStrategy[Step] = st.one_of(publishes(), publishes(), removes(), st.builds(Snap))
"""Mostly writes, to grow the table."""


def sequences(step: st.SearchStrategy[Step], max_size: int) -> st.SearchStrategy[list[Step]]:
    """Lists whose length is drawn uniformly first (`st.lists` averages ~6 steps)."""
    return st.integers(1, max_size).flatmap(lambda n: st.lists(step, min_size=n, max_size=n))


# ------------------------------------------------------------------- runner


PRELUDE: list[Step] = [RegisterNode(n, "h", "e", (), 1, 3_000, 0) for n in NODES]
"""Every node registered at first (leases end at 3000), so writes apply early."""
LONG_PRELUDE: list[Step] = [RegisterNode(n, "h", "e", (), 1, 60_000, 0) for n in NODES]
"""Every node registered with a lease that outlasts the test's clock."""


def image_of(t: Table) -> tuple[object, ...]:
    img = snapshot.capture(t)
    return ([a.tobytes() for a in img.arrays], img.keys, img.heads, img.meta)


def run_against_model(steps_: list[Step], cap: int, snap_path: Path) -> None:
    t = Table()
    shadow = Table()  # the same commands, never snapshotted
    m = Model(cap)
    captured: list[tuple[snapshot.Image, dict[str, Any], int]] = []
    for i, step in enumerate(steps_):
        cmd = resolve(step, m)
        where = f"after step {i} ({cmd!r})"
        combos = lookups_at(i)
        if isinstance(cmd, Snap):
            t = restore(t, snap_path)
            combos = ALL_LOOKUPS
            # Restoring is exact (free lists included), not merely equivalent.
            assert image_of(t) == image_of(shadow), f"{where}: restored table differs"
        elif isinstance(cmd, Capture):
            captured.append((snapshot.capture(t), copy.deepcopy(observe_model(m, ALL_LOOKUPS)), i))
            continue
        else:
            got, want = norm(t.apply(cmd)), norm(m.apply(cmd))
            assert got == want, f"{where}: result {got} != model {want}"
            shadow.apply(cmd)
        assert_same(observe_table(t, combos), observe_model(m, combos), where)
    want = observe_model(m, ALL_LOOKUPS)
    assert_same(observe_table(t, ALL_LOOKUPS), want, "at the end")
    # A restored copy answers identically.
    assert_same(observe_table(restore(t, snap_path), ALL_LOOKUPS), want, "restored at the end")
    # Images captured earlier are unaffected by everything applied since.
    for image, want_then, i in captured:
        snapshot.write(image, str(snap_path), {"index": i}, [])
        back, raft, _ = snapshot.read(str(snap_path))
        assert raft == {"index": i}
        assert_same(observe_table(back, ALL_LOOKUPS), want_then, f"image captured at step {i}")


def restore(t: Table, path: Path) -> Table:
    snapshot.write(snapshot.capture(t), str(path), {}, [])
    back, _, _ = snapshot.read(str(path))
    return back


@pytest.fixture(scope="module")
def snap_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snap") / "table.snap"


PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(sequences(any_step, 50))
def test_table_matches_model(snap_path: Path, steps_: list[Step]) -> None:
    run_against_model(PRELUDE + steps_, HOLDERS_PER_BLOCK_MAX, snap_path)


@PROPERTY
@given(sequences(st.one_of(busy_step, busy_step, any_step), 50))
def test_table_matches_model_with_a_tiny_holder_cap(snap_path: Path, steps_: list[Step]) -> None:
    """With 2 holders per block, eviction of the oldest holder happens all the time."""
    with mock.patch.object(table_mod, "HOLDERS_PER_BLOCK_MAX", 2):
        run_against_model(LONG_PRELUDE + steps_, 2, snap_path)


@PROPERTY
@given(sequences(busy_step, 50))
def test_table_matches_model_busy(snap_path: Path, steps_: list[Step]) -> None:
    """Every node registered up front, then mostly publishes and removes."""
    run_against_model(LONG_PRELUDE + steps_, HOLDERS_PER_BLOCK_MAX, snap_path)


@PROPERTY
@given(sequences(any_step, 30))
def test_table_matches_model_from_empty(snap_path: Path, steps_: list[Step]) -> None:
    """No prelude: commands from unregistered nodes, first registrations."""
    run_against_model(steps_, HOLDERS_PER_BLOCK_MAX, snap_path)
