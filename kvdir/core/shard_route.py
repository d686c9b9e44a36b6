"""Routing chains by a shard map with a memo: no blake2b for a block seen before.

`ShardMap.positions_by_group` costs a blake2b per block (about 0.3 us, so
0.15 ms for a 500-block chain); lookups ask about the same prefixes again and
again, so the group of each hash seen is remembered. The map is fixed per
`Router` (a new map, a new router), so a remembered group is never wrong.

Two memos, by the chain's form:

- 8-byte hashes packed in one buffer (the wire form of kvdir's and vLLM's
  chains): an open-addressing table of the hashes as u64 keys (`_Memo64`),
  probed for the whole chain at once with numpy: a dict probed per block,
  with a bytes object made per block first, cost more than the table lookups
  it routed (a 500-block chain over 4 groups on the 2-core host, parsing the
  request included: 150-200 us through the dict, 95-110 us through the table).
- any other chain: a dict from hash bytes, one probe per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np
import numpy.typing as npt

from kvdir.core.shard_map import ShardMap

ROUTES_MAX = 1 << 20
"""Block hashes whose group is remembered per memo (at most 40 B each in `_Memo64`,
about 100 B in the dict); forgotten all at once."""
_MIX = np.uint64(0x9E3779B97F4A7C15)
"""Fibonacci hashing: the home slot is the top bits of key * 2^64/phi, which spreads
keys that are not uniform (small integers) as well as keys that are."""
_EMPTY = -1
SCALAR_KEYS_MAX = 16
"""Keys left unsettled by the vectorized probe rounds that are probed one by one."""
LOAD_INVERSE = 4
"""At most a quarter full: a probe ends at the first slot for ~85% of keys, by the
third for nearly all (at half full, a quarter of them needed more)."""


class _Memo64:
    """u64 key -> group index (int16: GROUPS_MAX is 1024), linear probing, at most
    a quarter full; reads and writes are vectorized over a whole chain.

    Starts small and grows by doubling up to `routes_max` keys (4 * routes_max
    slots), then is cleared whole: a lost memo costs a blake2b per block again."""

    def __init__(self, routes_max: int, bits: int = 3) -> None:
        self.routes_max = routes_max
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        self.bits = bits
        self.keys = np.zeros(1 << bits, np.uint64)
        self.vals = np.full(1 << bits, _EMPTY, np.int16)
        self.size = 0

    def _home(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        return ((keys * _MIX) >> np.uint64(64 - self.bits)).astype(np.int64)

    def get(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.int16]:
        """Each key's group index, or -1 where it is not remembered."""
        mask = (1 << self.bits) - 1
        # The first probe of every key at once, with no index arrays: a quarter full,
        # it settles ~85% of them (a hit, or an empty slot: not remembered).
        slot = self._home(keys)
        v = self.vals[slot]
        hit = self.keys[slot] == keys
        hit &= v != _EMPTY  # an empty slot's key is 0, which is a valid key too
        out = np.where(hit, v, np.int16(_EMPTY))
        pending = np.flatnonzero(~hit & (v != _EMPTY))  # another key's slot: go on
        slot = (slot[pending] + 1) & mask
        # Then rounds over the keys left while there are more than a few: a round costs
        # about ten numpy calls (~1 us each on the 2-core host) whatever it settles, a
        # key probed alone with Python ints a fraction of a microsecond per slot, and
        # the longest probe sequence is tens of slots. A chain of 500 remembered keys:
        # 35 us with 16 left to the loop (40 with 8, 42 with 64; two rounds and then
        # numpy scalars one by one, as before: 45).
        # Every probe below is bounded by the table's size: the table is never full
        # (put grows it first), but a lookup on another thread than a put may see it
        # mid-change, and an unbounded probe would then spin; a key given up on is
        # "not remembered" (its group is computed again), never a wrong answer.
        rounds = mask + 1
        while len(pending) > SCALAR_KEYS_MAX and rounds:
            rounds -= 1
            v = self.vals[slot]
            hit = (v != _EMPTY) & (self.keys[slot] == keys[pending])
            out[pending[hit]] = v[hit]
            on = (v != _EMPTY) & ~hit
            pending, slot = pending[on], (slot[on] + 1) & mask
        table_keys, table_vals = self.keys, self.vals
        size = min(len(table_vals), mask + 1)
        for i, first in zip(pending.tolist(), slot.tolist(), strict=True):
            k, s = keys.item(i), first % size  # Python ints: a numpy scalar compare costs more
            for _ in range(size):
                val = table_vals.item(s)
                if val == _EMPTY:
                    break
                if table_keys.item(s) == k:
                    out[i] = val
                    break
                s = (s + 1) % size
        return out

    def put(self, keys: npt.NDArray[np.uint64], vals: npt.NDArray[np.int16]) -> None:
        keys, first = np.unique(keys, return_index=True)  # a chain may repeat a hash
        vals = vals[first]
        if self.size + len(keys) > self.routes_max:
            self._alloc(3)  # forget everything (bounded memory)
        while LOAD_INVERSE * (self.size + len(keys)) > (1 << self.bits):
            self._grow()
        mask = (1 << self.bits) - 1
        pending = np.arange(len(keys))
        slot = self._home(keys)
        # Each round: a key found in place is updated; of the keys probing one empty
        # slot, one takes it and the others look at it again (taken) next round;
        # a key on another key's slot moves on. Every round places or advances each.
        while len(pending):
            v = self.vals[slot]
            same = (v != _EMPTY) & (self.keys[slot] == keys[pending])
            self.vals[slot[same]] = vals[pending[same]]
            empty = v == _EMPTY
            at = np.flatnonzero(empty)
            taken, win = np.unique(slot[at], return_index=True)
            self.keys[taken] = keys[pending[at[win]]]
            self.vals[taken] = vals[pending[at[win]]]
            self.size += len(taken)
            keep = ~same
            keep[at[win]] = False
            pending, slot = (
                pending[keep],
                np.where(empty[keep], slot[keep], (slot[keep] + 1) & mask),
            )

    def _grow(self) -> None:
        used = self.vals != _EMPTY
        keys, vals = self.keys[used], self.vals[used]
        self._alloc(self.bits + 1)
        self.put(keys, vals)


class Router:
    def __init__(self, shard_map: ShardMap, routes_max: int = ROUTES_MAX) -> None:
        self.map = shard_map
        self.routes_max = routes_max
        self._gids = [g.group_id for g in shard_map.groups]
        self._routes: dict[bytes, int] = {}
        """Block hash -> index of its group in `_gids`."""
        self._memo64 = _Memo64(routes_max)

    def positions(self, hashes: Sequence[bytes]) -> dict[str, npt.NDArray[np.int64]]:
        """Chain positions by owning group, ascending, groups in the order of their
        first block: `ShardMap.positions_by_group`'s answer, as int64 arrays."""
        routes, n = self._routes, len(hashes)
        idx = np.fromiter(map(routes.get, hashes, repeat(-1, n)), np.int64, n)
        if n and idx.min() < 0:
            missing = [hashes[i] for i in np.flatnonzero(idx < 0).tolist()]
            if len(routes) + len(missing) > self.routes_max:
                routes.clear()  # a lost memo costs a blake2b per block, nothing else
            for g, pos in self.map.positions_by_group(missing).items():
                gi = self._gids.index(g)
                for i in pos:
                    routes[missing[i]] = gi
            idx = np.fromiter(map(routes.__getitem__, hashes), np.int64, n)
        return self._by_group(idx)

    def positions_packed(self, data: bytes, width: int) -> dict[str, npt.NDArray[np.int64]]:
        """`positions` of a chain packed as `width`-byte hashes back to back."""
        if width != 8:
            return self.positions([data[i : i + width] for i in range(0, len(data), width)])
        keys = np.frombuffer(data, np.uint64)
        idx = self._memo64.get(keys)
        miss = np.flatnonzero(idx < 0)
        if len(miss):
            hashes = [data[8 * i : 8 * i + 8] for i in miss.tolist()]
            groups = np.empty(len(miss), np.int16)
            for g, pos in self.map.positions_by_group(hashes).items():
                groups[pos] = self._gids.index(g)
            idx[miss] = groups
            self._memo64.put(keys[miss], groups)
        return self._by_group(idx)

    def _by_group(self, idx: npt.NDArray[np.integer]) -> dict[str, npt.NDArray[np.int64]]:
        # One stable sort: each group's positions come out ascending, and the first
        # of each run is that group's first block (the order groups are listed in).
        order = np.argsort(idx, kind="stable")
        counts = np.bincount(idx)
        present = np.flatnonzero(counts)  # a map may have 1,024 groups: loop over these
        ends = np.cumsum(counts)[present].tolist()
        starts = [e - c for e, c in zip(ends, counts[present].tolist(), strict=True)]
        runs = sorted(
            (int(order[a]), gi, order[a:b])
            for gi, a, b in zip(present.tolist(), starts, ends, strict=True)
        )
        return {self._gids[gi]: pos for _, gi, pos in runs}
