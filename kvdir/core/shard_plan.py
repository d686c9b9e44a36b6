"""A chain's routing over the groups, computed once and kept: a lookup `Plan`.

A sharded mirror's lookup of a chain asks each group's table for the part
of the chain the group owns and interleaves the groups' records back into
chain order. Routing the chain (the memo's probes and the split by group),
cutting each group's part out of it and its fingerprints cost more than the
table lookups themselves: 25-30 numpy calls per lookup whatever the chain's
length. None of that depends on the tables, only on the chain and the map,
and chains are asked about again and again (a scheduler asks for every
waiting request at each step, the fetch path for what it routed). So a
`Plan` keeps what a lookup needs of its chain:

- each group's part as a `Chain` with its fingerprints computed (what the
  table's run-following lookup compares);
- the record layout: the groups' parts back to back, and `order`, the
  permutation that puts a layout in chain order (one take per width of
  column);
- how many leading blocks the first group owns (records of a prefix inside
  them need no interleaving at all).

`Plans` remembers them by the chain's bytes, for one map (a new map, new
`Plans`), so a remembered plan is never wrong; bounded by the blocks held.
A chain that extends a remembered one (a conversation's next turn) is
another chain: its plan is made whole (its hashes' groups come from the
router's memo, not from the shorter chain's plan).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from kvdir.core.shard_route import Router
from kvdir.directory.lookup import Chain, PackedRecords, RecordColumns

PLAN_BLOCKS_MAX = 1 << 18
"""Chain blocks whose plans are remembered (about 56 B each: ~14 MiB); the oldest
plans are forgotten first."""

_COLUMNS = (
    ("addresses", "<u8", 8),
    ("lengths", "<u4", 4),
    ("rkeys", "<u4", 4),
    ("generations", "<u8", 8),
    ("tiers", "u1", 1),
)
"""PackedRecords' fields, in order: element type (little-endian) and size."""
_INDEXED = tuple(enumerate(_COLUMNS))


@dataclass(frozen=True, slots=True)
class Part:
    """The blocks of a chain that one group owns."""

    group_id: str
    positions: npt.NDArray[np.int64]
    """Their chain positions, ascending."""
    chain: Chain
    """Their hashes, in chain order (the group's lookup)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How one chain's lookup is split over the groups and merged back."""

    blocks: int
    parts: tuple[Part, ...]
    """Groups in the order of their first block: parts[0] owns block 0."""
    sizes: tuple[int, ...]
    """Blocks of each part."""
    firsts: tuple[int, ...]
    """Each part's first chain position."""
    lead_run: int
    """Blocks from block 0 on that parts[0] owns before another group's first."""
    order: npt.NDArray[np.intp]
    """Chain position -> index in the layout of the parts' records back to back, then
    the same plus `blocks`: two columns of one width laid out one after the other
    are put in chain order by one take (`records`)."""

    @classmethod
    def of(cls, chain: Chain, positions: Mapping[str, npt.NDArray[np.int64]]) -> Plan:
        """The plan of `chain` routed as `positions` (`Router`'s answer: ascending
        positions by group, groups in the order of their first block)."""
        n = len(chain)
        at = np.concatenate(list(positions.values()))  # the record layout, in chain positions
        sizes = tuple(len(p) for p in positions.values())
        if chain.packed:
            # Every part's hashes and fingerprints cut out by one take each, then sliced:
            # a take and a fingerprinting per part cost twice as much at 4 groups.
            w = chain.width
            data = np.frombuffer(chain.data, f"S{w}")[at].tobytes()
            fps = np.frombuffer(chain.fingerprint_bytes(), np.uint64)[at].tobytes()
            subs, a = [], 0
            for size in sizes:
                b = a + size
                subs.append(Chain(data[a * w : b * w], w, fingerprints=fps[8 * a : 8 * b]))
                a = b
        else:
            items = chain.items()
            subs = [Chain.of([items[i] for i in p.tolist()]) for p in positions.values()]
        parts = tuple(Part(g, p, s) for (g, p), s in zip(positions.items(), subs, strict=True))
        order = np.empty(2 * n, np.intp)
        order[at] = np.arange(n)
        order[n:] = order[:n] + n
        lead_run = int(parts[1].positions[0]) if len(parts) > 1 else n
        firsts = tuple(int(p.positions[0]) for p in parts)
        return cls(n, parts, sizes, firsts, lead_run, order)

    def records(self, prefix: int, got: Sequence[RecordColumns | None]) -> PackedRecords:
        """One holder's records of chain blocks 0..prefix-1, in chain order, from each
        part's records (`got[i]`: parts[i]'s group's records of the holder's prefix
        of that part, None where it holds none of it).

        Each part's records must cover its blocks below `prefix` (as the merge's
        bound, computed from the same answers, makes sure)."""
        whole = True  # every part's records cover the whole part
        for part, n, rec in zip(self.parts, self.sizes, got, strict=True):
            held = 0 if rec is None else len(rec[4])  # tiers: one byte per block
            # The merge bound: a part's answer ends at or after the prefix.
            assert held == n or part.positions.item(held) >= prefix, "merge bound broken"
            whole = whole and held == n
        if prefix <= self.lead_run:  # every block of it is the lead's, in order already
            lead = got[0]
            assert lead is not None or prefix == 0
            if lead is None:
                return PackedRecords(b"", b"", b"", b"", b"")
            return PackedRecords(*[_head(lead[i], size * prefix) for i, (_, _, size) in _INDEXED])
        n = self.blocks
        take = self.order if prefix == n else np.concatenate(
            (self.order[:prefix], self.order[n : n + prefix])
        )  # fmt: skip
        wide: list[bytes | array[int]]
        narrow: list[bytes | array[int]]
        tiers: list[bytes | array[int]]
        if whole:  # the usual case: the parts' columns are the layout as they are
            full = cast("Sequence[RecordColumns]", got)
            wide = [r[0] for r in full] + [r[3] for r in full]
            narrow = [r[1] for r in full] + [r[2] for r in full]
            tiers = [r[4] for r in full]
        else:
            wide = [*self._padded(0, 8, got), *self._padded(3, 8, got)]
            narrow = [*self._padded(1, 4, got), *self._padded(2, 4, got)]
            tiers = [*self._padded(4, 1, got)]
        # Two columns of one width in one take: three takes, not five.
        addresses, generations = _split(_take(wide, "<u8", take), 8 * prefix)
        lengths, rkeys = _split(_take(narrow, "<u4", take), 4 * prefix)
        return PackedRecords(
            addresses, lengths, rkeys, generations, _take(tiers, "u1", take[:prefix])
        )

    def _padded(self, column: int, size: int, got: Sequence[RecordColumns | None]) -> list[bytes]:
        """A column of each part padded to the part's length: a holder's answer may
        end before its part does (`take` reads no block past the prefix)."""
        pieces = []
        for n, rec in zip(self.sizes, got, strict=True):
            col = b"" if rec is None else bytes(rec[column])
            pieces.append(col.ljust(n * size, b"\0"))
        return pieces


def _head(col: bytes | array[int], nbytes: int) -> bytes:
    """The first `nbytes` bytes of a column."""
    return memoryview(col).cast("B")[:nbytes].tobytes()


def _split(both: bytes, at: int) -> tuple[bytes, bytes]:
    return both[:at], both[at:]


def _take(pieces: Sequence[bytes | array[int]], dtype: str, take: npt.NDArray[np.intp]) -> bytes:
    """The parts' columns laid out back to back, put in chain order by one 1-D take
    (the two columns of one width as rows of a 2-D array: numpy's 2-D fancy index
    cost 7 us for 500 blocks, a take of both 1.2 us)."""
    return np.frombuffer(b"".join(pieces), dtype).take(take).tobytes()


class Plans:
    """Plans of the chains looked up, for one map (`router.map`); thread-safe."""

    def __init__(self, router: Router, blocks_max: int = PLAN_BLOCKS_MAX) -> None:
        self.router = router
        self.blocks_max = blocks_max
        self._plans: dict[tuple[int, int, bytes], tuple[bytes, Plan]] = {}
        """(the chain's packed hashes, its plan) by `_key`: insertion order is age."""
        self._blocks = 0
        self._lock = threading.Lock()
        """Held to make and keep a plan (the router's memo is not thread-safe); a
        remembered plan is read without it."""
        self.made = 0
        """Plans made (lookups whose chain was not remembered)."""

    def plan(self, chain: Chain) -> Plan:
        if not chain.packed:  # mixed widths (rare): planned every time
            with self._lock:
                self.made += 1
                return Plan.of(chain, self._route(chain))
        key = _key(chain)
        got = self._plans.get(key)
        if got is not None and got[0] == chain.data:
            return got[1]
        with self._lock:
            got = self._plans.get(key)
            if got is not None and got[0] == chain.data:  # made by another thread meanwhile
                return got[1]
            p = Plan.of(chain, self._route(chain))
            self.made += 1
            if len(chain) <= self.blocks_max:
                self._keep(key, chain.data, p)
            return p

    def _route(self, chain: Chain) -> dict[str, npt.NDArray[np.int64]]:
        groups = self.router.map.groups
        if len(groups) == 1:  # no hash to route: one group owns every block
            return {groups[0].group_id: np.arange(len(chain), dtype=np.int64)}
        if chain.packed:
            return self.router.positions_packed(chain.data, chain.width)
        return self.router.positions(chain.items())

    def _keep(self, key: tuple[int, int, bytes], data: bytes, p: Plan) -> None:
        """Under `_lock`: the oldest plans go until `p` fits (a plan under the same key
        for another chain is replaced)."""
        old = self._plans.pop(key, None)
        if old is not None:
            self._blocks -= old[1].blocks
        while self._blocks + p.blocks > self.blocks_max:
            oldest = next(iter(self._plans))
            self._blocks -= self._plans.pop(oldest)[1].blocks
        self._plans[key] = (data, p)
        self._blocks += p.blocks


def _key(chain: Chain) -> tuple[int, int, bytes]:
    """A packed chain's key among the plans: its width, length and last two hashes.
    Hashing the whole chain (4 KB for 500 blocks, a new bytes object per request)
    cost more than the rest of finding its plan; the chain's bytes are compared
    with the plan's once found (one memcmp), so two chains with the same key just
    take turns."""
    return chain.width, chain.n, chain.data[-2 * chain.width :]
