"""Prefix lookups over a `Table`'s slot columns.

A lookup of a 500-block chain is on the hot path of every request a scheduler
routes, and per-block Python work (a dict probe, then column reads that each
create a Python int) cost more than the RPC around it. So the work is per
*run* of consecutive slots, not per block: C-level compares of the columns'
bytes accept a whole run, and records leave as packed little-endian bytes
sliced from the columns, never as Python ints. Chains of mixed hash widths
and the rare repairs (a block held in two tiers, a run whose node or
namespace columns differ) use numpy views of the columns instead.

Invariant: a numpy view exports the `array` buffer it views, and an exported
`array` cannot grow (BufferError). Views are therefore made and dropped inside
one call (`_views`), under the replica lock that `apply` also takes; nothing
that leaves this module refers to a column's memory.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain as _concat
from itertools import repeat
from typing import TYPE_CHECKING, Any, overload

import numpy as np

if TYPE_CHECKING:
    from kvdir.directory.block_index import BlockIndex
    from kvdir.directory.table import Columns, Match, Table

NIL = 0xFFFFFFFF
_TIER_WORST = 255


@dataclass(frozen=True, slots=True)
class PackedRecords:
    """Holder records of a prefix as packed little-endian columns."""

    addresses: bytes  # u64 each
    lengths: bytes  # u32 each
    rkeys: bytes  # u32 each
    generations: bytes  # u64 each
    tiers: bytes  # u8 each


class Runs(Sequence[int]):
    """The slots of a prefix held as several runs of consecutive slots.

    A chain that reached the table in several Publish commands (an engine
    publishes per request, so a multi-turn conversation's prefix is one run
    per turn; a batch boundary splits a chain too) is stored as one run per
    command. Keeping the runs as ranges lets records be sliced per run
    (`packed_records`) instead of gathered slot by slot, and costs nothing
    per slot to build.
    """

    __slots__ = ("_n", "ranges")

    def __init__(self, ranges: list[range]) -> None:
        self.ranges = ranges
        self._n = sum(map(len, ranges))

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return _concat.from_iterable(self.ranges)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return list(self)[i]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(i)
        for r in self.ranges:
            if j < len(r):
                return r[j]
            j -= len(r)
        raise AssertionError("unreachable: j was checked against the length")

    def __repr__(self) -> str:
        return f"Runs({self.ranges!r})"


class Chain:
    """A lookup chain: block hashes in order, packed when they share one width.

    The packed form (one bytes object, `width` bytes per hash) is what the
    fast path needs: the run check compares 8-byte fingerprints of the whole
    chain in one vectorised step, and only the few blocks where a run breaks
    are materialised as Python bytes for a dict probe.
    """

    __slots__ = ("_fpb", "_items", "data", "n", "width")

    def __init__(
        self,
        data: bytes,
        width: int,
        items: list[bytes] | None = None,
        fingerprints: bytes | None = None,
    ) -> None:
        """`fingerprints`: `fingerprint_bytes()` when the caller has them already (a
        part of a chain cut out with its fingerprints, kvdir.core.shard_plan)."""
        self.data = data
        self.width = width
        self.n = len(items) if items is not None else (len(data) // width if width else 0)
        self._items = items
        self._fpb: bytes | None = fingerprints

    @classmethod
    def of(cls, hashes: Sequence[bytes]) -> Chain:
        items = list(hashes)
        widths = set(map(len, items))
        if len(widths) == 1:
            return cls(b"".join(items), widths.pop(), items)
        return cls(b"", 0, items)

    def __len__(self) -> int:
        return self.n

    @property
    def packed(self) -> bool:
        return self.width > 0

    def item(self, i: int) -> bytes:
        if self._items is not None:
            return self._items[i]
        return self.data[i * self.width : (i + 1) * self.width]

    def items(self) -> list[bytes]:
        if self._items is None:
            w = self.width
            self._items = [self.data[i : i + w] for i in range(0, self.n * w, w)]
        return self._items

    def fingerprint_bytes(self) -> bytes:
        """The chain's `fingerprints` in `Columns.fp`'s memory form (native-endian
        u64): a stretch of that column holds the same bytes exactly when it holds
        the same fingerprints. Cached."""
        if self._fpb is None:
            hashes = [] if self.width == 8 else self.items()
            self._fpb = fingerprints(hashes, {self.width}, self.data).tobytes()
        return self._fpb


def fingerprint(key: bytes) -> int:
    """`Columns.fp` of one hash: its first 8 bytes as a big-endian u64, zero-padded
    (the column a lookup compares before any key)."""
    return int.from_bytes(key[:8].ljust(8, b"\0"), "big")


def fingerprints(hashes: Sequence[bytes], widths: set[int], joined: bytes = b"") -> array[int]:
    """`fingerprint` of each hash as an `array("Q")`; `widths` is the set of their
    lengths and `joined` their concatenation when that is {8} (a packed chain has it
    already).

    Hashes of 8 bytes or more (every engine's) take one join and a byte swap
    instead of an int built per hash, which was half of a fresh publish's apply."""
    out = array("Q")
    if widths == {8}:
        out.frombytes(joined or b"".join(hashes))
    elif widths and min(widths) > 8:
        out.frombytes(b"".join([h[:8] for h in hashes]))
    else:
        out.extend(map(fingerprint, hashes))
        return out
    if _LITTLE:
        out.byteswap()
    return out


class _V:
    """Numpy views of the columns, each made on first use (~1 us each) and all
    dropped when the `with` block ends (`_views`)."""

    _DTYPES = {
        "addr": np.uint64,
        "length": np.uint32,
        "rkey": np.uint32,
        "gen": np.uint64,
        "tier": np.uint8,
        "node": np.uint32,
        "bnext": np.uint32,
        "fp": np.uint64,
        "kw": np.uint8,
        "solo": np.uint8,
        "ns": np.uint32,
        "dual": np.uint8,
    }

    def __init__(self, c: Columns) -> None:
        self._c = c
        self._made: list[str] = []

    def __getattr__(self, name: str) -> Any:
        dtype = _V._DTYPES.get(name)
        if dtype is None:
            raise AttributeError(name)
        view = np.frombuffer(getattr(self._c, name), dtype)
        setattr(self, name, view)
        self._made.append(name)
        return view

    def __enter__(self) -> _V:
        return self

    def __exit__(self, *exc: object) -> None:
        # Drop the exports now, even when unwinding: a traceback that kept a
        # view alive would make the next append in `apply` fail.
        d = self.__dict__
        for name in self._made:
            del d[name]
        self._made.clear()


def _views(c: Columns) -> _V:
    """`with _views(c) as v:` numpy views of `c`'s columns for this block only (a
    class, not a generator context manager: this runs on every lookup)."""
    return _V(c)


def longest_prefixes(
    table: Table, namespace: str, chain: Chain, exclude: int
) -> list[tuple[int, Any]]:
    """(node index, slots of its contiguous prefix) for every holder of block 0: a
    `range` when the prefix is one run of consecutive slots, else an int64 array."""
    ns = table.ns_ids.get(namespace)
    if ns is None or not chain.n:  # attributes, not len() and properties: a sharded
        return []  # mirror makes this call once per group of every lookup
    blocks = table.blocks[ns]
    s0 = blocks.get(chain.item(0), NIL)
    if s0 == NIL:
        return []
    c = table.col
    if chain.width:  # packed
        if c.bnext[s0] == NIL:  # block 0 has one holder: no walk
            node = c.node[s0]
            if node == exclude:
                return []
            if _whole_run(c, chain, ns, s0, node):
                return [(node, range(s0, s0 + chain.n))]
            return [(node, _follow_runs(blocks, c, chain, ns, s0))]
        # Only the holders of block 0 can hold a prefix: follow each one's runs.
        starts = _holder_starts(c, s0, exclude)
        return [(n, _follow_runs(blocks, c, chain, ns, s)) for n, s in starts]
    n = len(chain)
    h = np.fromiter(map(blocks.get, chain.items(), repeat(NIL, n)), np.int64, n)
    gaps = np.flatnonzero(h == NIL)
    if len(gaps):
        h = h[: gaps[0]]
    with _views(c) as v:
        if bool((v.bnext[h] == NIL).all()):
            return _single_holder(v, h, exclude)
        return _multi_holder(v, h, exclude)


def _whole_run(c: Columns, chain: Chain, ns: int, s: int, node: int) -> bool:
    """Whether slots s.. hold the whole chain for `node`, none of its blocks in two
    tiers: then `_follow_runs`' answer is that one run. The usual answer (a chain, or
    a group's part of one, published in one batch), found with one compare per
    column and none of `_follow_runs`' steps (a 125-block part, one group's of a
    500-block chain over 4: 4.6 -> 3.1 us). Anything else (False) is left to
    `_follow_runs`."""
    n, w = chain.n, chain.width
    e = s + n
    return (
        e <= len(c.key)
        and c.fp[s:e].tobytes() == chain.fingerprint_bytes()
        and c.node[s:e].tobytes() == _U32.pack(node) * n
        and c.ns[s:e].tobytes() == _U32.pack(ns) * n
        and c.kw[s:e].tobytes() == bytes((w,)) * n
        and b"\x01" not in c.dual[s:e].tobytes()
        # Wider hashes: the whole keys too (the slots are the node's: every key set).
        and (w <= 8 or b"".join(c.key[s:e]) == chain.data)  # type: ignore[arg-type]
    )


def _holder_starts(c: Columns, head: int, exclude: int) -> list[tuple[int, int]]:
    """(node, its best-tier slot) for each holder on block 0's chain, in chain order."""
    best: dict[int, int] = {}
    s = head
    while s != NIL:
        n = c.node[s]
        if n != exclude and (n not in best or c.tier[s] < c.tier[best[n]]):
            best[n] = s
        s = c.bnext[s]
    return list(best.items())


def _follow_runs(blocks: BlockIndex, c: Columns, chain: Chain, ns: int, s0: int) -> Any:
    """Prefix of node(s0), a holder of block 0: follow runs of consecutive slots.

    A holder that published a chain in one batch stored it in consecutive
    slots, so slot s+1 usually holds block i+1: one comparison per run accepts
    it without a dict probe per block (`_run`). Where a run breaks, one dict
    probe finds the node's slot for that block and a new run starts there; a
    block the node does not hold ends the prefix. Blocks the node holds in two
    tiers (`dual`) are re-resolved through their holder chain so the node's
    best tier wins. One clean run is a `range` and several are `Runs` (no
    slot list is built); a prefix with a re-resolved block is an int64 array.
    """
    n, node = chain.n, c.node[s0]
    nslots = len(c.key)
    runs: list[Any] = []
    i, s = 0, s0
    while i < n:
        run = _run(c, chain, i, s, min(n - i, nslots - s), ns, node)
        if run == 0:
            # The index named a slot whose row does not match the block (only a
            # damaged row can): the prefix ends here, rather than probing it forever.
            break
        slots: Any = range(s, s + run)
        if b"\x01" in c.dual[s : s + run].tobytes():
            patched = np.arange(s, s + run, dtype=np.int64)
            with _views(c) as v:
                dual = np.flatnonzero(v.dual[s : s + run]).tolist()
            for j in dual:
                patched[j] = _best_slot(c, blocks.get(chain.item(i + j), NIL), node)
            slots = patched
        runs.append(slots)
        i += run
        if i >= n:
            break
        s = _best_slot(c, blocks.get(chain.item(i), NIL), node)
        if s == NIL:
            break
    if len(runs) == 1:
        return runs[0]
    if all(isinstance(r, range) for r in runs):
        return Runs(runs)
    return np.concatenate([np.arange(r.start, r.stop) if isinstance(r, range) else r for r in runs])


def prefix_lengths(
    table: Table, namespace: str, chain: Chain, exclude: int
) -> list[tuple[int, int]]:
    """(node index, length of its contiguous prefix) for every holder of block 0.

    The routing form of `longest_prefixes`: the same walk, without gathering
    the prefix's slots (a block held in two tiers counts once either way)."""
    ns = table.ns_ids.get(namespace)
    if ns is None or not len(chain) or not chain.packed:
        return [(n, len(s)) for n, s in longest_prefixes(table, namespace, chain, exclude)]
    blocks = table.blocks[ns]
    s0 = blocks.get(chain.item(0), NIL)
    if s0 == NIL:
        return []
    c = table.col
    starts = _holder_starts(c, s0, exclude)
    return [(n, _run_length(blocks, c, chain, ns, s)) for n, s in starts]


def _run_length(blocks: BlockIndex, c: Columns, chain: Chain, ns: int, s0: int) -> int:
    """As `_follow_runs`, counting the prefix's blocks instead of listing its slots."""
    n, node = len(chain), c.node[s0]
    nslots = len(c.key)
    i, s = 0, s0
    while i < n:
        run = _run(c, chain, i, s, min(n - i, nslots - s), ns, node)
        if run == 0:  # a damaged row (see _follow_runs): the prefix ends here
            break
        i += run
        if i >= n:
            break
        s = _best_slot(c, blocks.get(chain.item(i), NIL), node)
        if s == NIL:
            break
    return i


def _run(c: Columns, chain: Chain, i: int, s: int, k: int, ns: int, node: int) -> int:
    """How many of slots s..s+k-1 hold blocks i..i+k-1 for `node` in namespace `ns`.

    Exact: a slot counts when its fingerprint, key width, namespace and node
    all match, and (hashes wider than 8 bytes) its whole key. The fingerprints
    are compared first, as bytes when the whole stretch matches (one memcmp)
    and else by bisection to find where they stop; the other columns are then
    checked over that run with C-level array compares, and only if one of
    them differs (which a holder's own run never does) is the exact vector
    compare over all four columns done to find where (numpy views are made for
    that case only: a lookup follows runs on each of several groups' tables,
    and views it never used were a tenth of each).
    """
    have = c.fp[s : s + k].tobytes()
    want = chain.fingerprint_bytes()[8 * i : 8 * (i + k)]
    run = k if have == want else _common_words(have, want, k)
    width = chain.width
    if run and not (
        c.node[s : s + run].tobytes() == _U32.pack(node) * run
        and c.ns[s : s + run].tobytes() == _U32.pack(ns) * run
        and c.kw[s : s + run].tobytes() == bytes((width,)) * run
    ):
        with _views(c) as v:
            ok = (
                (v.kw[s : s + run] == width)
                & (v.ns[s : s + run] == ns)
                & (v.node[s : s + run] == node)
            )
            run = int(ok.argmin()) if not ok.all() else run
    if width > 8 and run:
        run = _same_keys(c.key, chain, i, s, run)
    return run


def _common_words(a: bytes, b: bytes, k: int) -> int:
    """How many leading 8-byte words `a` and `b` (k words each, not equal) share.

    A bisection of C-level slice compares: about log2(k) memcmps over a
    halving stretch, where a numpy compare would first need views of the
    column and of the chain (the common case of a run that ends at a
    command's boundary takes this path once per run)."""
    lo, hi = 0, k  # a[:lo] == b[:lo] in words; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[8 * lo : 8 * mid] == b[8 * lo : 8 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _same_keys(keys: list[bytes | None], chain: Chain, i: int, s: int, run: int) -> int:
    """How many of slots s.. really hold blocks i.. (the fingerprint covers 8 bytes).

    One C-level join and memcmp over the run (its slots are the node's, so
    none is free and every key is set); a mismatch (two wide hashes that
    share their first 8 bytes) is located block by block, which never happens
    with real digests but keeps the answer exact.
    """
    stored = keys[s : s + run]
    w = chain.width
    if b"".join(stored) == chain.data[i * w : (i + run) * w]:  # type: ignore[arg-type]
        return run
    for j in range(run):
        if stored[j] != chain.item(i + j):
            return j
    return run


def _best_slot(c: Columns, head: int, node: int) -> int:
    """`node`'s slot on a holder chain, best tier first; NIL if it holds none (the
    `array` columns: a scalar read from one is a third of a numpy scalar's cost)."""
    best, s = NIL, head
    nodes, tiers, bnext = c.node, c.tier, c.bnext
    while s != NIL:
        if nodes[s] == node and (best == NIL or tiers[s] < tiers[best]):
            best = s
        s = bnext[s]
    return best


def _single_holder(v: _V, h: Any, exclude: int) -> list[tuple[int, Any]]:
    """Every block has exactly one holder slot: one node, cut at its first gap."""
    nodes = v.node[h]
    n0 = int(nodes[0])
    if n0 == exclude:
        return []
    other = np.flatnonzero(nodes != n0)
    run = int(other[0]) if len(other) else len(h)
    return [(n0, h[:run])]


def _multi_holder(v: _V, h: Any, exclude: int) -> list[tuple[int, Any]]:
    """Walk the holder chains level by level (all blocks at once per level)."""
    levels = [h]
    cur = h
    while True:
        live = cur != NIL
        nxt = np.full_like(cur, NIL)
        nxt[live] = v.bnext[cur[live]]
        if bool((nxt == NIL).all()):
            break
        levels.append(nxt)
        cur = nxt
    level_nodes, level_tiers = [], []
    for lv in levels:
        live = lv != NIL
        safe = np.where(live, lv, 0)
        level_nodes.append(np.where(live, v.node[safe], NIL))
        level_tiers.append(np.where(live, v.tier[safe], _TIER_WORST))
    candidates: list[int] = []
    for ln in level_nodes:
        n = int(ln[0])
        if n not in (NIL, exclude) and n not in candidates:
            candidates.append(n)
    out = []
    for n in candidates:
        best = np.full(len(h), NIL, dtype=np.int64)
        best_tier = np.full(len(h), _TIER_WORST, dtype=np.uint8)
        for lv, ln, lt in zip(levels, level_nodes, level_tiers, strict=True):
            better = (ln == n) & (lt < best_tier)
            best[better] = lv[better]
            best_tier[better] = lt[better]
        gaps = np.flatnonzero(best == NIL)
        run = int(gaps[0]) if len(gaps) else len(h)
        out.append((n, best[:run]))
    return out


def packed_records(table: Table, slots: Sequence[int]) -> PackedRecords:
    if isinstance(slots, range) and slots.step == 1:
        return _packed_run(table.col, slots.start, slots.stop)
    if isinstance(slots, Runs):
        return _packed_runs(table.col, slots.ranges)
    s = np.asarray(slots, dtype=np.int64)
    n = len(s)
    if n and int(s[-1]) - int(s[0]) == n - 1 and (n < 3 or bool((np.diff(s) == 1).all())):
        return _packed_run(table.col, int(s[0]), int(s[0]) + n)
    with _views(table.col) as v:
        return PackedRecords(
            v.addr[s].astype("<u8", copy=False).tobytes(),
            v.length[s].astype("<u4", copy=False).tobytes(),
            v.rkey[s].astype("<u4", copy=False).tobytes(),
            v.gen[s].astype("<u8", copy=False).tobytes(),
            v.tier[s].tobytes(),
        )


RecordColumns = tuple["bytes | array[int]", "bytes | array[int]", "bytes | array[int]",
                      "bytes | array[int]", "bytes | array[int]"]  # fmt: skip
"""Holder records as `PackedRecords`' five columns in its order, each little-endian
bytes or a little-endian host's `array` of them (`record_columns`)."""


def record_columns(table: Table, slots: Sequence[int]) -> RecordColumns:
    """`packed_records` as buffers for a reader that joins them itself (a sharded
    mirror's merge): the columns' own slices for a run of consecutive slots on a
    little-endian host (copies, so valid after the lock; no bytes made of them, no
    record built: a merge of four groups did that 4 times per holder), else
    `packed_records`' bytes."""
    if _LITTLE and isinstance(slots, range) and slots.step == 1:
        c, a, b = table.col, slots.start, slots.stop
        return c.addr[a:b], c.length[a:b], c.rkey[a:b], c.gen[a:b], c.tier[a:b]
    r = packed_records(table, slots)
    return r.addresses, r.lengths, r.rkeys, r.generations, r.tiers


def _packed_run(c: Columns, a: int, b: int) -> PackedRecords:
    """Records of slots a..b-1 (a run of consecutive slots, the usual answer): plain
    memory copies."""
    if not _LITTLE:
        return _packed_runs(c, (range(a, b),))
    return PackedRecords(
        c.addr[a:b].tobytes(), c.length[a:b].tobytes(), c.rkey[a:b].tobytes(),
        c.gen[a:b].tobytes(), c.tier[a:b].tobytes(),
    )  # fmt: skip


def _packed_runs(c: Columns, rs: Sequence[range]) -> PackedRecords:
    """Records of several runs of consecutive slots: per column, the runs' memory
    joined (byte-swapped to little-endian on a big-endian host)."""
    return PackedRecords(
        _le(c.addr, rs), _le(c.length, rs), _le(c.rkey, rs), _le(c.gen, rs),
        b"".join([c.tier[r.start : r.stop].tobytes() for r in rs]),
    )  # fmt: skip


def _le(col: array[int], rs: Sequence[range]) -> bytes:
    """Little-endian bytes of `col` over the runs `rs` (arrays are native-endian)."""
    if _LITTLE:
        return b"".join([col[r.start : r.stop].tobytes() for r in rs])
    out = array(col.typecode)
    for r in rs:
        out.extend(col[r.start : r.stop])
    out.byteswap()
    return out.tobytes()


_LITTLE = sys.byteorder == "little"
_U32 = struct.Struct("@I")
"""One u32 column value's bytes (`array("I")`'s item: C unsigned int, native): one call,
where an `array` built to be dumped cost two and half again the time."""


def sort_matches(matches: list[Match], max_nodes: int) -> list[Match]:
    if len(matches) > 1:  # most prefixes have one holder: no key tuples to build
        matches.sort(key=lambda m: (-len(m.slots), m.node.node_id))
    return matches[:max_nodes]
