"""Prefix lookups over a `Table`'s slot columns, vectorised with numpy.

A lookup of a 500-block chain is on the hot path of every request a scheduler
routes, and per-block Python work (a dict probe, then column reads that each
create a Python int) cost more than the RPC around it. So after one C-level
pass of dict probes for the chain heads, everything else (the holder walk,
the prefix cut, the record gathers) runs on numpy views of the columns, and
records leave as packed little-endian bytes, never as Python ints.

Invariant: a numpy view exports the `array` buffer it views, and an exported
`array` cannot grow (BufferError). Views are therefore made and dropped inside
one call (`_views`), under the replica lock that `apply` also takes; nothing
that leaves this module refers to a column's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from directory.table import Columns, Match, Table

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


@dataclass(slots=True)
class _V:
    addr: Any
    length: Any
    rkey: Any
    gen: Any
    tier: Any
    node: Any
    bnext: Any


@contextmanager
def _views(c: Columns) -> Iterator[_V]:
    v = _V(
        np.frombuffer(c.addr, np.uint64),
        np.frombuffer(c.length, np.uint32),
        np.frombuffer(c.rkey, np.uint32),
        np.frombuffer(c.gen, np.uint64),
        np.frombuffer(c.tier, np.uint8),
        np.frombuffer(c.node, np.uint32),
        np.frombuffer(c.bnext, np.uint32),
    )
    try:
        yield v
    finally:
        # Drop the exports now, even when unwinding: a traceback that kept a
        # view alive would make the next append in `apply` fail.
        v.addr = v.length = v.rkey = v.gen = v.tier = v.node = v.bnext = None


def longest_prefixes(
    table: Table, namespace: str, chain: list[bytes], exclude: int
) -> list[tuple[int, list[int]]]:
    """(node index, slots of its contiguous prefix) for every holder of block 0."""
    ns = table.ns_ids.get(namespace)
    if ns is None or not chain:
        return []
    n = len(chain)
    h = np.fromiter(map(table.blocks[ns].get, chain, repeat(NIL, n)), np.int64, n)
    gaps = np.flatnonzero(h == NIL)
    if len(gaps):
        h = h[: gaps[0]]
    if not len(h):
        return []
    with _views(table.col) as v:
        if bool((v.bnext[h] == NIL).all()):
            return _single_holder(v, h, exclude)
        return _multi_holder(v, h, exclude)


def _single_holder(v: _V, h: Any, exclude: int) -> list[tuple[int, list[int]]]:
    """Every block has exactly one holder slot: one node, cut at its first gap."""
    nodes = v.node[h]
    n0 = int(nodes[0])
    if n0 == exclude:
        return []
    other = np.flatnonzero(nodes != n0)
    run = int(other[0]) if len(other) else len(h)
    return [(n0, h[:run].tolist())]


def _multi_holder(v: _V, h: Any, exclude: int) -> list[tuple[int, list[int]]]:
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
        out.append((n, best[:run].tolist()))
    return out


def packed_records(table: Table, slots: list[int]) -> PackedRecords:
    with _views(table.col) as v:
        s = np.array(slots, dtype=np.int64)
        return PackedRecords(
            v.addr[s].astype("<u8", copy=False).tobytes(),
            v.length[s].astype("<u4", copy=False).tobytes(),
            v.rkey[s].astype("<u4", copy=False).tobytes(),
            v.gen[s].astype("<u8", copy=False).tobytes(),
            v.tier[s].tobytes(),
        )


def sort_matches(matches: list[Match], max_nodes: int) -> list[Match]:
    matches.sort(key=lambda m: (-len(m.slots), m.node.node_id))
    return matches[:max_nodes]
