"""Routing chains by a shard map with a memo: one dict probe per known block.

`ShardMap.positions_by_group` costs a blake2b per block (about 0.3 us, so
0.15 ms for a 500-block chain); lookups ask about the same prefixes again and
again, so the group of each hash seen is remembered. The map is fixed per
`Router` (a new map, a new router), so a remembered group is never wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np
import numpy.typing as npt

from kvdir.core.shard_map import ShardMap

ROUTES_MAX = 1 << 20
"""Block hashes whose group is remembered (about 100 B each); forgotten all at once."""


class Router:
    def __init__(self, shard_map: ShardMap, routes_max: int = ROUTES_MAX) -> None:
        self.map = shard_map
        self.routes_max = routes_max
        self._gids = [g.group_id for g in shard_map.groups]
        self._routes: dict[bytes, int] = {}
        """Block hash -> index of its group in `_gids`."""

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
        first = np.unique(idx, return_index=True)
        order = sorted(zip(first[1].tolist(), first[0].tolist(), strict=True))
        return {self._gids[gi]: np.flatnonzero(idx == gi) for _, gi in order}
