"""The directory's state machine: a prefix table with no Raft, I/O or clock.

`Table.apply(command)` is the only way state changes; it is deterministic (the
same commands in the same order give the same state and results on every
replica) and reads time only from the commands. Lookups are pure reads.

Layout, chosen for memory (<= 200 bytes per (block, holder) entry at 10M) and
cheap snapshots: holder records live in *slots*, parallel `array` columns
indexed by slot number. Per namespace a `BlockIndex` (a dict split in 256:
block_index.py says why) maps a block hash to the first slot of its holder
chain (singly linked through ``bnext``); per node a doubly
linked list (``nprev``/``nnext``) threads all of its slots, so clearing or
expiring a node costs its own entries, not the table's. Freed slots are
reused through a free list chained through ``bnext``.

The key column is the only per-entry Python container; the cyclic garbage
collector is kept from walking it (`untracked` says why that matters and why
it is safe).

Thread-safety: none here; the Raft adapter serialises `apply` against reads.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import ClassVar, cast

import numpy as np
import numpy.typing as npt

from kvdir.core.shard_map import ShardMap
from kvdir.core.wire import HASH_BYTES_MAX
from kvdir.directory import lookup as prefix_lookup
from kvdir.directory import shard_moves
from kvdir.directory.block_index import BlockIndex
from kvdir.directory.commands import (
    Barrier,
    BeginImport,
    ClearNode,
    Command,
    Done,
    DropShard,
    Expired,
    ExpireNodes,
    FreezeShard,
    Heartbeat,
    Import,
    ImportDone,
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
    SetShardMap,
    ShardMapSet,
    Tier,
)
from kvdir.directory.limits import HOLDERS_PER_BLOCK_MAX
from kvdir.directory.shard_fence import ShardFence
from kvdir.directory.shard_view import handover_error

NIL = 0xFFFFFFFF
"""End of a slot chain, and the node index of a free slot."""

_TIERS = frozenset(int(t) for t in Tier)


@dataclass(slots=True)
class NodeState:
    """A registered holder node (one per node id)."""

    node_id: str
    host: str
    endpoint: str
    transports: tuple[str, ...]
    incarnation: int
    lease_ms: int
    lease_expiry_ms: int
    head: int = NIL
    """First slot of this node's entry list."""
    entries: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """One node's contiguous prefix from block 0 and the slots holding it."""

    node: NodeState
    slots: Sequence[int] = field(default_factory=list)
    """Slot of each prefix block (from lookups: a `range` for one run of consecutive
    slots, a `lookup.Runs` for several, else an int64 numpy array)."""

    @property
    def prefix_blocks(self) -> int:
        return len(self.slots)


@dataclass(frozen=True, slots=True)
class Records:
    """Holder records of a list of slots, as columns."""

    addresses: tuple[int, ...]
    lengths: tuple[int, ...]
    rkeys: tuple[int, ...]
    generations: tuple[int, ...]
    tiers: tuple[int, ...]


def _gc_untrack() -> Callable[[object], None] | None:
    if sys.implementation.name != "cpython":
        return None
    fn = ctypes.pythonapi.PyObject_GC_UnTrack
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    return cast("Callable[[object], None]", fn)


_GC_UNTRACK = _gc_untrack()


def untracked(keys: list[bytes | None]) -> list[bytes | None]:
    """`keys`, no longer walked by the cyclic garbage collector.

    A full collection visits every element of every tracked list, and each
    visit reads the element's type: a cache miss per key, the keys being
    scattered over the heap. With 2.4M entries a full collection took 25 ms
    (2 ms without the key list), growing with the table and holding the GIL
    of a replica's Raft thread or of a mirror's host process all along.
    Safe because the list only ever holds bytes and None, which hold no
    references and so cannot be part of a cycle; CPython never tracks a list
    again once it is untracked, and frees it by reference count as before."""
    if _GC_UNTRACK is not None:
        _GC_UNTRACK(keys)
    return keys


class Columns:
    """The slot columns; one element per slot, free or used."""

    __slots__ = (
        "_key",
        "addr",
        "bnext",
        "dual",
        "fp",
        "gen",
        "kw",
        "length",
        "nnext",
        "node",
        "nprev",
        "ns",
        "rkey",
        "solo",
        "tier",
    )

    def __init__(self) -> None:
        self.addr = array("Q")
        self.length = array("I")
        self.rkey = array("I")
        self.gen = array("Q")
        self.tier = array("B")
        self.node = array("I")
        self.ns = array("I")
        self.bnext = array("I")
        self.nprev = array("I")
        self.nnext = array("I")
        self.fp = array("Q")
        """First 8 bytes of the key, big-endian, zero-padded (lookup's run check)."""
        self.kw = array("B")
        """Key width in bytes."""
        self.solo = array("B")
        """1 when this slot is its block's only holder (lookup's fast path)."""
        self.dual = array("B")
        """1 when the same node also holds this block in another tier (lookup's
        fast path then re-resolves the node's best tier)."""
        self._key: list[bytes | None] = untracked([])

    @property
    def key(self) -> list[bytes | None]:
        """The block hash of each slot (None: free)."""
        return self._key

    @key.setter
    def key(self, keys: list[bytes | None]) -> None:
        self._key = untracked(keys)

    ARRAYS: ClassVar[tuple[str, ...]] = (
        "addr",
        "length",
        "rkey",
        "gen",
        "tier",
        "node",
        "ns",
        "bnext",
        "nprev",
        "nnext",
        "fp",
        "kw",
        "solo",
        "dual",
    )
    """Names of the numeric columns, in the snapshot's fixed order."""

    def arrays(self) -> list[array[int]]:
        """The numeric columns, in the snapshot's fixed order (`ARRAYS`)."""
        return [getattr(self, name) for name in self.ARRAYS]

    @classmethod
    def of(cls, arrays: list[array[int]], keys: list[bytes | None]) -> Columns:
        """Columns over existing arrays (in `ARRAYS` order), not copied."""
        c = cls()
        for name, a in zip(cls.ARRAYS, arrays, strict=True):
            setattr(c, name, a)
        c.key = keys
        return c

    def __len__(self) -> int:
        return len(self.key)


Row = tuple[int | bytes | None, ...]
"""One slot's value in every column: the numeric ones in `Columns.ARRAYS` order, then the key."""


@dataclass(eq=False, slots=True)
class Freeze:
    """The table as it was at `Table.freeze`, kept by copy-on-write until `Table.thaw`.

    Only a slot below `slots` that changes after the freeze costs anything: its
    whole row, as it was, goes into `undo` the first time, before it changes.
    Whoever copies the columns later (on any thread) and then overwrites every
    slot of `undo` with its saved row gets the table as frozen (snapshot.py)."""

    arrays: list[array[int]]
    """The table's own numeric columns (live: they keep changing)."""
    keys: list[bytes | None]
    slots: int
    undo: dict[int, Row] = field(default_factory=dict)


def _ranks(
    column: npt.NDArray[np.uint32], name_of: Callable[[int], str]
) -> tuple[npt.NDArray[np.uint32], list[str]]:
    """Each element's rank among the sorted names of the indexes `column` holds, and
    those names sorted (one name under two indexes shares one rank)."""
    present, inverse = np.unique(column, return_inverse=True)
    names = [name_of(int(i)) for i in present]
    order = sorted(set(names))
    rank_of = {n: i for i, n in enumerate(order)}
    rank = np.array([rank_of[n] for n in names], dtype=np.uint32)
    return rank[inverse], order


class Table:
    """The replicated prefix table. See the module docstring for the layout."""

    def __init__(self) -> None:
        self.frozen: tuple[Freeze, ...] = ()
        """Captures still being copied (see `freeze`); empty almost always."""
        self._freeze_lock = threading.Lock()
        self.col = Columns()
        self.free = NIL
        self.entries = 0
        self.ns_ids: dict[str, int] = {}
        self.ns_names: list[str] = []
        self.blocks: list[BlockIndex] = []
        self.nodes: dict[str, NodeState] = {}
        self.node_by_idx: list[NodeState | None] = []
        self.node_idx: dict[str, int] = {}
        self.free_node_idx: list[int] = []
        self.shard_map: ShardMap | None = None
        """The committed shard map (only the home group's log ever sets one)."""
        self.fence = ShardFence()
        """Shards moving away (frozen) or in (importing): shard_fence.py."""

    # ------------------------------------------------------------ copy-on-write

    def freeze(self) -> Freeze:
        """Start a capture: O(1), between two applies. From now on every slot below
        the current slot count keeps its current row in the returned `Freeze`
        until `thaw` (the caller copies the live columns meanwhile, on any thread)."""
        f = Freeze(self.col.arrays(), self.col.key, len(self.col))
        with self._freeze_lock:
            self.frozen = (*self.frozen, f)
        return f

    def thaw(self, f: Freeze) -> None:
        """End a capture (idempotent): its slots change freely again."""
        with self._freeze_lock:
            self.frozen = tuple(x for x in self.frozen if x is not f)

    def _keep(self, s: int) -> None:
        """Slot `s` is about to change: save its row for every capture that has not yet.

        Every in-place write below to a slot that may predate a freeze is preceded
        by this (guarded by `if self.frozen`, so it costs one test otherwise); a
        missed call would let a snapshot mix two table states."""
        for f in self.frozen:
            if s < f.slots and s not in f.undo:
                f.undo[s] = (*(a[s] for a in f.arrays), f.keys[s])

    # ----------------------------------------------------------------- apply

    def apply(self, cmd: Command) -> Result:
        """Apply one committed command. Deterministic; never raises on input."""
        match cmd:
            case Publish():
                return self._fenced(cmd.hashes) or self._publish(cmd)
            case Remove():
                return self._fenced(cmd.hashes) or self._remove(cmd)
            case Heartbeat():
                return self._heartbeat(cmd)
            case RegisterNode():
                return self._register(cmd)
            case ClearNode():
                return self._clear(cmd)
            case ExpireNodes():
                return self._expire(cmd)
            case Barrier():
                return Done()
            case SetShardMap():
                return self._set_shard_map(cmd)
            case FreezeShard() | BeginImport() | Import() | ImportDone() | DropShard():
                return shard_moves.apply(self, cmd)

    def _fenced(self, hashes: Sequence[bytes]) -> Rejected | None:
        """A write naming a key of a frozen or importing shard is refused whole."""
        if not self.fence:
            return None
        hit = self.fence.fenced(hashes)
        if hit is None:
            return None
        i, r = hit
        what = "moving away (frozen)" if r.shard_id in self.fence.frozen else "still importing"
        return Rejected(
            Reject.SHARD_FENCED,
            f"block {hashes[i].hex()} is in shard {r.shard_id}, {what} here: "
            "refresh the shard map and retry",
        )

    def _set_shard_map(self, cmd: SetShardMap) -> Result:
        """Compare-and-set: checked again here, in log order, whatever the proposer saw."""
        current = 0 if self.shard_map is None else self.shard_map.version
        if cmd.expected_version != current:
            return Rejected(
                Reject.STALE_SHARD_MAP,
                f"shard map version {cmd.expected_version} expected, {current} is committed",
            )
        if cmd.shard_map.version != current + 1:
            return Rejected(
                Reject.BAD_SHARD_MAP,
                f"the new shard map must be version {current + 1}, not {cmd.shard_map.version}",
            )
        why = handover_error(self.shard_map, cmd.shard_map)
        if why is not None:
            return Rejected(Reject.BAD_SHARD_MAP, why)
        self.shard_map = cmd.shard_map
        return ShardMapSet(cmd.shard_map)

    def _check_node(self, node_id: str, incarnation: int) -> NodeState | Rejected:
        node = self.nodes.get(node_id)
        if node is None:
            return Rejected(Reject.UNKNOWN_NODE, f"node {node_id!r} is not registered")
        if node.incarnation != incarnation:
            return Rejected(
                Reject.STALE_INCARNATION,
                f"node {node_id!r} incarnation {incarnation} is not the current {node.incarnation}",
            )
        return node

    def _register(self, cmd: RegisterNode) -> Result:
        node = self.nodes.get(cmd.node_id)
        expiry = cmd.now_ms + cmd.lease_ms
        replaced = False
        if node is not None and cmd.incarnation < node.incarnation:
            return Rejected(
                Reject.STALE_INCARNATION,
                f"node {cmd.node_id!r} incarnation {cmd.incarnation} is older than the "
                f"registered {node.incarnation}",
            )
        if node is not None and cmd.incarnation > node.incarnation:
            # A restarted agent: nothing the old incarnation published is valid.
            self._drop_node_entries(node, None)
            replaced = True
        if node is None:
            node = NodeState(
                cmd.node_id,
                cmd.host,
                cmd.endpoint,
                cmd.transports,
                cmd.incarnation,
                cmd.lease_ms,
                expiry,
            )
            self._add_node(node)
        node.host, node.endpoint, node.transports = cmd.host, cmd.endpoint, cmd.transports
        node.incarnation, node.lease_ms = cmd.incarnation, cmd.lease_ms
        node.lease_expiry_ms = max(node.lease_expiry_ms, expiry)
        return Registered(node.lease_expiry_ms, node.lease_ms, replaced)

    def _add_node(self, node: NodeState) -> None:
        if self.free_node_idx:
            idx = self.free_node_idx.pop()
            self.node_by_idx[idx] = node
        else:
            idx = len(self.node_by_idx)
            self.node_by_idx.append(node)
        self.nodes[node.node_id] = node
        self.node_idx[node.node_id] = idx

    def _forget_node(self, node: NodeState) -> None:
        idx = self.node_idx.pop(node.node_id)
        del self.nodes[node.node_id]
        self.node_by_idx[idx] = None
        self.free_node_idx.append(idx)

    def _heartbeat(self, cmd: Heartbeat) -> Result:
        node = self._check_node(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        node.lease_expiry_ms = max(node.lease_expiry_ms, cmd.now_ms + node.lease_ms)
        return Renewed(node.lease_expiry_ms)

    def _ns(self, namespace: str) -> int:
        ns = self.ns_ids.get(namespace)
        if ns is None:
            ns = len(self.ns_names)
            self.ns_ids[namespace] = ns
            self.ns_names.append(namespace)
            self.blocks.append(BlockIndex())
        return ns

    def _publish(self, cmd: Publish) -> Result:
        node = self._check_node(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        if cmd.tier not in _TIERS:
            return Rejected(Reject.BAD_TIER, f"tier {cmd.tier} is not a holder tier")
        n = len(cmd.hashes)
        if not (
            len(cmd.addresses) == len(cmd.lengths) == len(cmd.rkeys) == len(cmd.generations) == n
        ):
            return Rejected(Reject.BAD_BATCH, "publish columns differ in length")
        widths = set(map(len, cmd.hashes))
        if widths and not (min(widths) > 0 and max(widths) <= HASH_BYTES_MAX):
            return Rejected(Reject.BAD_BATCH, f"hash widths must be 1..{HASH_BYTES_MAX}")
        ns = self._ns(cmd.namespace)
        blocks = self.blocks[ns]
        nidx = self.node_idx[cmd.node_id]
        if self.free == NIL and n > 1 and self._fresh(blocks, cmd.hashes):
            self._append_fresh(cmd, ns, nidx, node, widths)
            return Published(n, 0)
        tier = cmd.tier
        c = self.col
        cnode, ctier, cnext, cgen = c.node, c.tier, c.bnext, c.gen
        applied = stale = 0
        for i, h in enumerate(cmd.hashes):
            head = blocks.get(h, NIL)
            s, count = head, 0
            while s != NIL and not (cnode[s] == nidx and ctier[s] == tier):
                s = cnext[s]
                count += 1
            gen = cmd.generations[i]
            if s != NIL:
                # Generations order the publishes of one slot; a record for another
                # slot (the block moved) is simply newer, since one node's changes
                # reach the log in order.
                if gen < cgen[s] and c.addr[s] == cmd.addresses[i]:
                    stale += 1
                    continue
                if self.frozen:
                    self._keep(s)
                c.addr[s], c.length[s], c.rkey[s], cgen[s] = (
                    cmd.addresses[i],
                    cmd.lengths[i],
                    cmd.rkeys[i],
                    gen,
                )
                applied += 1
                continue
            if count >= HOLDERS_PER_BLOCK_MAX:
                self._evict_oldest_holder(blocks, h, head)
                head = blocks.get(h, NIL)
            s = self._alloc(ns, h, nidx, node)
            c.addr[s], c.length[s], c.rkey[s], cgen[s], ctier[s] = (
                cmd.addresses[i],
                cmd.lengths[i],
                cmd.rkeys[i],
                gen,
                tier,
            )
            cnext[s] = head
            sib = self._sibling(head, nidx)
            if self.frozen:
                self._keep(sib)  # NIL is never below a freeze's slot count
                self._keep(head)
            if sib != NIL:
                c.dual[s] = c.dual[sib] = 1
            if head == NIL:
                c.solo[s] = 1
            else:
                c.solo[s] = c.solo[head] = 0
            blocks[h] = s
            applied += 1
        return Published(applied, stale)

    @staticmethod
    def _fresh(blocks: BlockIndex, hashes: list[bytes]) -> bool:
        """No block of the batch is known yet and none repeats (a set, one probe per hash)."""
        return len(set(hashes)) == len(hashes) and blocks.isdisjoint(hashes)

    def _append_fresh(
        self, cmd: Publish, ns: int, nidx: int, node: NodeState, widths: set[int]
    ) -> None:
        """Bulk insert of a batch of new blocks: one extend per column.

        The common publish (a prefill's new blocks) costs a few C-level passes
        instead of a Python loop per entry, and lands in consecutive slots in
        chain order, which is what the lookup's run-following fast path reads.
        Only used while the free list is empty, so slot reuse is unaffected.
        Same result as inserting the entries one by one (each is its block's
        only holder, linked at the head of the node's list in batch order).
        """
        c = self.col
        n = len(cmd.hashes)
        start = len(c.key)
        c.addr.extend(cmd.addresses)
        c.length.extend(cmd.lengths)
        c.rkey.extend(cmd.rkeys)
        c.gen.extend(cmd.generations)
        c.tier.frombytes(bytes((cmd.tier,)) * n)
        c.solo.frombytes(b"\x01" * n)
        c.dual.frombytes(bytes(n))
        c.node.extend(array("I", (nidx,)) * n)  # a repeated array: one memcpy per column
        c.ns.extend(array("I", (ns,)) * n)
        c.bnext.extend(array("I", (NIL,)) * n)
        c.fp.extend(prefix_lookup.fingerprints(cmd.hashes, widths))
        c.kw.frombytes(bytes(map(len, cmd.hashes)))
        c.key.extend(cmd.hashes)
        # Node list: the batch's last entry becomes the head (as one-by-one inserts
        # would leave it), each entry points back to the one inserted before it.
        old_head = node.head
        c.nnext.extend(chain((old_head,), range(start, start + n - 1)))
        c.nprev.extend(chain(range(start + 1, start + n), (NIL,)))
        if old_head != NIL:
            if self.frozen:
                self._keep(old_head)
            c.nprev[old_head] = start
        node.head = start + n - 1
        node.entries += n
        self.entries += n
        self.blocks[ns].add_run(cmd.hashes, start)

    def _alloc(self, ns: int, key: bytes, nidx: int, node: NodeState) -> int:
        """Take a slot, owned by `node`, linked at the head of the node's list."""
        c = self.col
        s = self.free
        fp = prefix_lookup.fingerprint(key)
        if self.frozen:
            self._keep(s)
            self._keep(node.head)
        if s != NIL:
            self.free = c.bnext[s]
            c.key[s] = key
            c.ns[s] = ns
            c.node[s] = nidx
            c.fp[s] = fp
            c.kw[s] = len(key)
        else:
            s = len(c.key)
            for col in (c.addr, c.gen):
                col.append(0)
            for col in (c.length, c.rkey, c.bnext, c.nprev, c.nnext):
                col.append(NIL)
            c.tier.append(0)
            c.solo.append(0)
            c.dual.append(0)
            c.node.append(nidx)
            c.ns.append(ns)
            c.fp.append(fp)
            c.kw.append(len(key))
            c.key.append(key)
        c.nprev[s] = NIL
        c.nnext[s] = node.head
        if node.head != NIL:
            c.nprev[node.head] = s
        node.head = s
        node.entries += 1
        self.entries += 1
        return s

    def _sibling(self, head: int, nidx: int) -> int:
        """The slot of node `nidx` on a holder chain (another tier of the block), or NIL."""
        c = self.col
        while head != NIL and c.node[head] != nidx:
            head = c.bnext[head]
        return head

    def _release(self, s: int) -> None:
        """Unlink slot `s` from its node's list and free it (block chain done by caller)."""
        c = self.col
        prev, nxt = c.nprev[s], c.nnext[s]
        if self.frozen:
            self._keep(s)
            self._keep(prev)
            self._keep(nxt)
        if c.dual[s]:
            key = c.key[s]
            assert key is not None
            sib = self._sibling(self.blocks[c.ns[s]].get(key, NIL), c.node[s])
            if sib != NIL:
                if self.frozen:
                    self._keep(sib)
                c.dual[sib] = 0
            c.dual[s] = 0
        node = self.node_by_idx[c.node[s]]
        assert node is not None, "slot owned by a forgotten node"
        if prev != NIL:
            c.nnext[prev] = nxt
        else:
            node.head = nxt
        if nxt != NIL:
            c.nprev[nxt] = prev
        node.entries -= 1
        self.entries -= 1
        c.node[s] = NIL
        c.solo[s] = 0
        c.key[s] = None
        c.bnext[s] = self.free
        self.free = s

    def _unlink_block(self, blocks: BlockIndex, key: bytes, s: int) -> None:
        """Remove slot `s` from the holder chain of `key`."""
        c = self.col
        head = blocks[key]
        if head == s:
            head = c.bnext[s]
            if head == NIL:
                del blocks[key]
                return
            blocks[key] = head
        else:
            p = head
            while c.bnext[p] != s:
                p = c.bnext[p]
            if self.frozen:
                self._keep(p)
            c.bnext[p] = c.bnext[s]
        if c.bnext[head] == NIL:
            if self.frozen:
                self._keep(head)
            c.solo[head] = 1

    def _evict_oldest_holder(self, blocks: BlockIndex, key: bytes, head: int) -> None:
        # New holders go to the head, so the tail is the longest-standing one.
        c = self.col
        s = head
        while c.bnext[s] != NIL:
            s = c.bnext[s]
        self._unlink_block(blocks, key, s)
        self._release(s)

    def _remove(self, cmd: Remove) -> Result:
        node = self._check_node(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        n = len(cmd.hashes)
        gens, addrs = cmd.generations, cmd.addresses
        if (gens and len(gens) != n) or (addrs and len(addrs) != n):
            return Rejected(Reject.BAD_BATCH, "remove guards differ in length from hashes")
        ns = self.ns_ids.get(cmd.namespace)
        if ns is None:
            return Removed(0)
        blocks = self.blocks[ns]
        nidx = self.node_idx[cmd.node_id]
        c = self.col
        removed = 0
        for i, h in enumerate(cmd.hashes):
            s = blocks.get(h, NIL)
            while s != NIL and not (c.node[s] == nidx and c.tier[s] == cmd.tier):
                s = c.bnext[s]
            if s == NIL or (gens and c.gen[s] > gens[i]) or (addrs and c.addr[s] != addrs[i]):
                continue
            self._unlink_block(blocks, h, s)
            self._release(s)
            removed += 1
        return Removed(removed)

    def _drop_node_entries(self, node: NodeState, namespace: int | None) -> int:
        c = self.col
        s = node.head
        removed = 0
        while s != NIL:
            nxt = c.nnext[s]
            if namespace is None or c.ns[s] == namespace:
                key = c.key[s]
                assert key is not None
                self._unlink_block(self.blocks[c.ns[s]], key, s)
                self._release(s)
                removed += 1
            s = nxt
        return removed

    def _clear(self, cmd: ClearNode) -> Result:
        node = self._check_node(cmd.node_id, cmd.incarnation)
        if isinstance(node, Rejected):
            return node
        if cmd.namespace is None or cmd.deregister:
            # A node that leaves takes every entry with it, whatever namespace was
            # named: entries must never outlive the node index they point at.
            removed = self._drop_node_entries(node, None)
        else:
            ns = self.ns_ids.get(cmd.namespace)
            removed = 0 if ns is None else self._drop_node_entries(node, ns)
        if cmd.deregister:
            self._forget_node(node)
        return Removed(removed)

    def _expire(self, cmd: ExpireNodes) -> Result:
        gone: list[str] = []
        removed = 0
        for node_id, incarnation in cmd.nodes:
            node = self.nodes.get(node_id)
            # Re-checked here: a heartbeat committed after the leader decided wins.
            if node is None or node.incarnation != incarnation:
                continue
            if node.lease_expiry_ms > cmd.now_ms:
                continue
            removed += self._drop_node_entries(node, None)
            self._forget_node(node)
            gone.append(node_id)
        return Expired(tuple(gone), removed)

    # ----------------------------------------------------------------- reads

    def expired_nodes(
        self, now_ms: int, limit: int, grace_from_ms: int = 0
    ) -> list[tuple[str, int]]:
        """Nodes whose lease ended by `now_ms` (for the leader to propose).

        A lease counts as renewed at `grace_from_ms` (when the proposing
        leader took over), so a new leader never expires a node sooner than a
        full lease after it started watching.
        """
        out = [
            (n.node_id, n.incarnation)
            for n in self.nodes.values()
            if max(n.lease_expiry_ms, grace_from_ms + n.lease_ms) <= now_ms
        ]
        out.sort()
        return out[:limit]

    def lookup(
        self,
        namespace: str,
        chain: Sequence[bytes] | prefix_lookup.Chain,
        max_nodes: int,
        exclude_node: str = "",
    ) -> list[Match]:
        """Each holder node's longest contiguous prefix of `chain` from block 0.

        Best first: longer prefix, then node id (deterministic). A node holding
        a block in several tiers contributes its best tier (GPU before host).
        """
        if max_nodes <= 0:
            return []
        exclude = self.node_idx.get(exclude_node, NIL) if exclude_node else NIL
        matches = []
        if not isinstance(chain, prefix_lookup.Chain):
            chain = prefix_lookup.Chain.of(chain)
        for n, slots in prefix_lookup.longest_prefixes(self, namespace, chain, exclude):
            node = self.node_by_idx[n]
            assert node is not None, "a slot points at a forgotten node"
            matches.append(Match(node, slots))
        return prefix_lookup.sort_matches(matches, max_nodes)

    def holder_prefixes(
        self, namespace: str, chain: prefix_lookup.Chain, max_nodes: int, exclude_node: str = ""
    ) -> list[tuple[NodeState, Sequence[int]]]:
        """`lookup`'s holders with their prefix's slots, in no set order and with no
        `Match` built: for a merge that orders holders itself (a sharded mirror, once
        per group). The same holders as `lookup`'s, cut at `max_nodes` as it cuts."""
        if max_nodes <= 0:
            return []
        exclude = self.node_idx.get(exclude_node, NIL) if exclude_node else NIL
        found = []
        for n, slots in prefix_lookup.longest_prefixes(self, namespace, chain, exclude):
            node = self.node_by_idx[n]
            assert node is not None, "a slot points at a forgotten node"
            found.append((node, slots))
        if len(found) > max_nodes:
            found.sort(key=lambda x: (-len(x[1]), x[0].node_id))
            del found[max_nodes:]
        return found

    def prefix_lengths(
        self, namespace: str, chain: prefix_lookup.Chain, max_nodes: int
    ) -> list[tuple[str, int]]:
        """(node id, prefix blocks) of `lookup`'s matches, in its order, with no
        slots gathered: what a router needs and nothing else."""
        if max_nodes <= 0:
            return []
        found = [
            (self._node_id(n), length)
            for n, length in prefix_lookup.prefix_lengths(self, namespace, chain, NIL)
        ]
        found.sort(key=lambda x: (-x[1], x[0]))
        return found[:max_nodes]

    def _node_id(self, n: int) -> str:
        node = self.node_by_idx[n]
        assert node is not None, "a slot points at a forgotten node"
        return node.node_id

    def records(self, slots: Sequence[int]) -> Records:
        """Holder records of `slots` as Python ints (tests, tools)."""
        c = self.col
        return Records(
            tuple(c.addr[s] for s in slots),
            tuple(c.length[s] for s in slots),
            tuple(c.rkey[s] for s in slots),
            tuple(c.gen[s] for s in slots),
            tuple(c.tier[s] for s in slots),
        )

    def packed_records(self, slots: Sequence[int]) -> prefix_lookup.PackedRecords:
        """Holder records of `slots` as packed little-endian bytes (the wire form)."""
        return prefix_lookup.packed_records(self, slots)

    def record_columns(self, slots: Sequence[int]) -> prefix_lookup.RecordColumns:
        """`packed_records`' columns as buffers (`lookup.record_columns`)."""
        return prefix_lookup.record_columns(self, slots)

    def digest(self) -> bytes:
        """SHA-256 of the table's content in a canonical order (not its slot layout).

        Two replicas that applied the same commands agree on it whether they
        built their table by applying entries or by loading a snapshot. A
        committed shard map and the move fences count (replicas must agree on
        them too); a table without either digests as it always did.
        """
        h = hashlib.sha256()
        if self.shard_map is not None:
            h.update(self.shard_map.to_json().encode())
        if self.fence:
            h.update(repr(self.fence.to_json()).encode())
        for n in sorted(self.nodes.values(), key=lambda n: n.node_id):
            ident = (n.node_id, n.host, n.endpoint, n.transports, n.incarnation, n.lease_ms)
            h.update(repr((*ident, n.lease_expiry_ms, n.entries)).encode())
        self._digest_records(h)
        return h.digest()

    def _digest_records(self, h: hashlib._Hash) -> None:
        """Every record, in the canonical order (namespace name, block hash, node id,
        tier, then the rest), as fixed-width big-endian rows, into `h`.

        In numpy: one row per record, sorted by `lexsort` and hashed as one buffer
        (hashlib drops the GIL for it). Tuples sorted and repr'd one by one took
        ~4 s per million records and held the interpreter while a replica's Raft
        thread waited (the 8M-entry evidence run of 2026-12-04 lost leaders to it)."""
        c = self.col
        keys = c.key
        used = [s for s, k in enumerate(keys) if k is not None]
        if not used:
            return
        idx = np.array(used, dtype=np.int64)
        ns = np.frombuffer(c.ns, dtype=np.uint32)[idx]
        node = np.frombuffer(c.node, dtype=np.uint32)[idx]
        # Names ranked among those the records use: the rows hold ranks, the names
        # go in once (a namespace or node without records leaves no trace).
        ns_rank, ns_names = _ranks(ns, lambda i: self.ns_names[i])
        node_rank, node_ids = _ranks(node, self._node_id_at)
        h.update(repr((ns_names, node_ids)).encode())
        kw = np.frombuffer(c.kw, dtype=np.uint8)[idx]
        rows = np.empty(
            len(used),
            dtype=[
                ("ns", ">u4"),
                ("key", f"S{int(kw.max())}"),
                ("kw", "u1"),
                ("node", ">u4"),
                ("tier", "u1"),
                ("addr", ">u8"),
                ("length", ">u4"),
                ("rkey", ">u4"),
                ("gen", ">u8"),
            ],
        )
        rows["ns"] = ns_rank
        rows["key"] = [keys[s] for s in used]
        rows["kw"] = kw
        rows["node"] = node_rank
        rows["tier"] = np.frombuffer(c.tier, dtype=np.uint8)[idx]
        rows["addr"] = np.frombuffer(c.addr, dtype=np.uint64)[idx]
        rows["length"] = np.frombuffer(c.length, dtype=np.uint32)[idx]
        rows["rkey"] = np.frombuffer(c.rkey, dtype=np.uint32)[idx]
        rows["gen"] = np.frombuffer(c.gen, dtype=np.uint64)[idx]
        order = np.lexsort(
            [rows[f] for f in ("gen", "rkey", "length", "addr", "tier", "node", "kw", "key", "ns")]
        )
        h.update(rows[order].tobytes())

    def _node_id_at(self, idx: int) -> str:
        node = self.node_by_idx[idx]
        return "" if node is None else node.node_id

    @property
    def block_count(self) -> int:
        return sum(len(b) for b in self.blocks)
