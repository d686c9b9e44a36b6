"""The benchmark's data: who holds which block chain, as a pure function of a few numbers.

`DataShape` describes a directory loaded the way a small serving fleet would
load it: `nodes` holder nodes, prompts of `chain_blocks` blocks (8-byte
hashes), each chain published by one node, and every `multi_every`-th chain
also held by a second node (so 1 / multi_every of the chains take the
directory's multi-holder lookup path). Everything derives from the chain and
block numbers, so the loader, the verifier, the lookups and the memory
measurement (a separate process) agree without shipping hashes around.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvdir.directory.commands import Tier

_MUL = 0x9E3779B97F4A7C15
"""Odd, so `i -> i * _MUL mod 2**64` is a bijection: distinct inputs, distinct hashes."""
_MASK = (1 << 64) - 1
WRITER_KEY_BASE = 1 << 48
"""Hash numbers of the failover writer's blocks start here (load blocks stay below)."""
FILLER_KEY = (1 << 48) - 1
BLOCK_BYTES = 65536
TIER = int(Tier.GPU)


def hash_of(i: int) -> bytes:
    """Block hash number `i` as 8 bytes (a scrambled, collision-free u64)."""
    return ((i * _MUL) & _MASK).to_bytes(8, "big")


def hashes(start: int, count: int) -> list[bytes]:
    return [((i * _MUL) & _MASK).to_bytes(8, "big") for i in range(start, start + count)]


@dataclass(frozen=True, slots=True)
class Batch:
    """One Publish: `count` consecutive entries of one node, as columns."""

    node: int
    hashes: list[bytes]
    addresses: list[int]
    lengths: list[int]
    rkeys: list[int]
    generations: list[int]


@dataclass(frozen=True, slots=True)
class DataShape:
    chains: int
    nodes: int = 16
    chain_blocks: int = 500
    multi_every: int = 5

    @classmethod
    def for_entries(
        cls, entries: int, nodes: int = 16, chain_blocks: int = 500, multi_every: int = 5
    ) -> DataShape:
        """The shape whose entry count is closest to `entries` (at least one chain)."""
        per_chain = chain_blocks * (1 + 1 / multi_every)
        return cls(max(1, round(entries / per_chain)), nodes, chain_blocks, multi_every)

    @property
    def multi_chains(self) -> int:
        return (self.chains + self.multi_every - 1) // self.multi_every

    @property
    def entries(self) -> int:
        return (self.chains + self.multi_chains) * self.chain_blocks

    @property
    def blocks(self) -> int:
        return self.chains * self.chain_blocks

    def node_id(self, n: int) -> str:
        return f"node-{n:02d}"

    def holders(self, chain: int) -> list[int]:
        """Node numbers holding `chain`: the publisher, then the second holder if any."""
        first = chain % self.nodes
        if chain % self.multi_every or self.nodes < 2:
            return [first]
        return [first, (first + max(1, self.nodes // 2 - 1)) % self.nodes]

    def chain_hashes(self, chain: int) -> list[bytes]:
        return hashes(chain * self.chain_blocks + 1, self.chain_blocks)

    def node_chains(self, n: int) -> list[int]:
        return [c for c in range(self.chains) if n in self.holders(c)]

    def batches(self, batch_entries: int) -> Iterator[Batch]:
        """Every entry once, as per-node batches of at most `batch_entries`.

        Nodes are interleaved batch by batch, as concurrent agents would
        publish. Addresses are distinct per node; generation 1 everywhere.
        """
        streams = [self._node_batches(n, batch_entries) for n in range(self.nodes)]
        while streams:
            alive = []
            for s in streams:
                b = next(s, None)
                if b is not None:
                    alive.append(s)
                    yield b
            streams = alive

    def _node_batches(self, n: int, batch_entries: int) -> Iterator[Batch]:
        pending: list[bytes] = []
        sent = 0
        base = (0x7F00 + n) << 32
        rkey = 0x1000 + n
        for c in self.node_chains(n):
            pending.extend(self.chain_hashes(c))
            while len(pending) >= batch_entries:
                part, pending = pending[:batch_entries], pending[batch_entries:]
                yield self._batch(n, part, base, sent, rkey)
                sent += len(part)
        if pending:
            yield self._batch(n, pending, base, sent, rkey)

    @staticmethod
    def _batch(n: int, part: list[bytes], base: int, sent: int, rkey: int) -> Batch:
        k = len(part)
        return Batch(
            n,
            part,
            [base + (sent + i) * BLOCK_BYTES for i in range(k)],
            [BLOCK_BYTES] * k,
            [rkey] * k,
            [1] * k,
        )

    def describe(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "chain_blocks": self.chain_blocks,
            "chains": self.chains,
            "multi_holder_chains": self.multi_chains,
            "multi_holder_fraction": round(self.multi_chains / self.chains, 4),
            "entries": self.entries,
            "distinct_blocks": self.blocks,
            "hash_bytes": 8,
            "tier": "GPU",
            "generation": 1,
        }


def writer_hashes(seq: int, per_batch: int) -> list[bytes]:
    """The failover writer's batch `seq`: fresh blocks, a chain of `per_batch`."""
    return hashes(WRITER_KEY_BASE + seq * per_batch, per_batch)
