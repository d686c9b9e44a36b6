"""Holder choice for a fetch: which peer, and over which path. Pure: no I/O, no clock.

Paths, cheapest first (what one block of KV costs to bring into this node):

    cuda       same-host GPU -> GPU through CUDA IPC, one kernel (docs/gpu.md)
    rdma-gpu   another host's GPU over RDMA with dma-buf. UNVERIFIED: no machine
               here has both a GPU and an RDMA device; chosen only when the
               agent's `rdma_gpu` flag is set (off by default)
    host       the holder's host copy over shm / rdma / tcp (the host pool path;
               into a GPU pool it is then uploaded from page-locked memory)

and, when no holder has anything usable, recompute (an empty plan).

Order: the longest valid prefix first (a longer prefix saves prefill that
no copy path costs as much as); among equal prefixes the cheapest path, then
a same-host holder (shm), then a random one (spreads load). A holder's prefix counts only
blocks of one tier: a GPU-path read stops where its records stop being GPU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvdir.v1 import directory_pb2 as pb

CUDA = "cuda"
RDMA_GPU = "rdma-gpu"
HOST = "host"
PATH_COST = {CUDA: 0, RDMA_GPU: 1, HOST: 2}
"""Rank of each path (lower is cheaper); recompute is the empty plan."""


@dataclass(frozen=True, slots=True)
class Reader:
    """What this node can use."""

    host: str
    """The address this agent publishes (holders on it are same-host candidates)."""
    gpu_pool: bool
    """Our pool for the namespace is GPU tier (a cuda or rdma-gpu read can land in it)."""
    cuda: bool
    """The cuda transport is loaded here."""
    rdma_gpu: bool = False
    """The unverified dma-buf RDMA path is switched on (config `rdma_gpu`)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """One holder's prefix of a chain and its records: the fetch path's typed read.

    The records stay in the directory table's packed little-endian columns (u64
    addresses, u32 lengths, u32 rkeys, u64 generations, u8 tiers; one entry per
    prefix block), the same bytes a NodeMatch carries on the wire, so a mirror
    answer becomes a Holder without building a message, and a ticket's holder
    becomes a message without re-packing."""

    node_id: str
    prefix_blocks: int
    host: str
    agent_endpoint: str
    transports: tuple[str, ...]
    addresses: bytes = b""
    lengths: bytes = b""
    rkeys: bytes = b""
    generations: bytes = b""
    tiers: bytes = b""

    @classmethod
    def of(cls, m: pb.NodeMatch) -> Holder:
        return cls(
            m.node_id, m.prefix_blocks, m.host, m.agent_endpoint, tuple(m.transports),
            m.addresses, m.lengths, m.rkeys, m.generations, m.tiers,
        )  # fmt: skip

    def message(self) -> pb.NodeMatch:
        """The wire form (a load ticket's holder)."""
        return pb.NodeMatch(
            node_id=self.node_id, prefix_blocks=self.prefix_blocks, host=self.host,
            agent_endpoint=self.agent_endpoint, transports=self.transports,
            addresses=self.addresses, lengths=self.lengths, rkeys=self.rkeys,
            generations=self.generations, tiers=self.tiers,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Candidate:
    match: Holder
    path: str
    blocks: int
    """Leading blocks this path can read from this holder (one tier)."""


def tier_run(tiers: bytes | Sequence[int], n: int) -> int:
    """How many leading records of `tiers` share the first one's tier (up to n)."""
    if n <= 0 or not tiers:
        return 0
    first = tiers[0]
    for i in range(1, min(n, len(tiers))):
        if tiers[i] != first:
            return i
    return min(n, len(tiers))


def path_of(match: Holder, reader: Reader) -> str:
    """The cheapest path this reader has to `match`'s blocks."""
    gpu_records = bool(match.tiers) and match.tiers[0] == pb.TIER_GPU
    same_host = match.host == reader.host
    if gpu_records and reader.gpu_pool:
        if same_host and reader.cuda and CUDA in match.transports:
            return CUDA
        if not same_host and reader.rdma_gpu and RDMA_GPU in match.transports:
            return RDMA_GPU
    return HOST


def rank(
    matches: Sequence[Holder],
    reader: Reader,
    healthy: Sequence[bool],
    rng: random.Random,
) -> list[Candidate]:
    """Usable holders, best first (`healthy[i]`: matches[i] is not in cooldown)."""
    keyed = []
    for i, m in enumerate(matches):
        n = tier_run(m.tiers, m.prefix_blocks) if m.tiers else m.prefix_blocks
        if n <= 0 or not m.agent_endpoint or not m.addresses or not healthy[i]:
            continue
        path = path_of(m, reader)
        near = m.host == reader.host and "shm" in m.transports
        keyed.append(((-n, PATH_COST[path], not near, rng.random()), Candidate(m, path, n)))
    keyed.sort(key=lambda kc: kc[0])
    return [c for _, c in keyed]
