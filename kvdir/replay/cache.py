"""A node's KV cache for the replay: finite capacity in blocks, LRU eviction.

It mirrors what a radix-tree prefix cache keeps: a request touches its chain
from the last block to the first, so a prefix is always more recent than its
extensions and eviction takes suffixes (leaves) before the prefixes they hang
from. The replay drives the agent's real pool from this model: every block
here has a slot there, and every eviction here is a `removed` + `Free` there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NodeCache:
    def __init__(self, capacity_blocks: int) -> None:
        assert capacity_blocks > 0, capacity_blocks
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()
        """block id -> slot in the node's pool (most recently used last)."""

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block: int) -> bool:
        return block in self._lru

    def prefix(self, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` are cached here."""
        n = 0
        for b in chain:
            if b not in self._lru:
                break
            n += 1
        return n

    def slot(self, block: int) -> int:
        return self._lru[block]

    def insert(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Blocks now cached in these slots (they become the most recent)."""
        assert len(blocks) == len(slots)
        for b, s in zip(blocks, slots, strict=True):
            assert b not in self._lru, b
            self._lru[b] = s

    def touch(self, chain: Sequence[int]) -> None:
        """A request used `chain`: last block first, so block 0 ends most recent."""
        for b in reversed(chain):
            if b in self._lru:
                self._lru.move_to_end(b)

    def make_room(self, incoming: int) -> list[tuple[int, int]]:
        """Evict so that `incoming` new blocks fit (never below zero entries)."""
        out = []
        while self._lru and len(self._lru) + incoming > self.capacity_blocks:
            out.append(self._lru.popitem(last=False))
        return out
