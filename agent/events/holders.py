"""Index-only holders: an engine's prefix cache as routing hints in the directory.

A stock engine's GPU slots are not registered with any transfer engine, so
its blocks are published with address 0, length 0 and rkey 0: the directory
tells a scheduler *which node* holds a prefix, and nobody reads it remotely.

Holder identity (docs/events.md): each engine DP rank is its own directory
node, ``<agent node id>/<engine name>/dp<rank>``, registered with the agent's
host and no transports (lookups show it as "index only"). DP ranks are
separate engines with separate caches, so they must not share a holder: a
removal on rank 1 must not withdraw rank 0's copy. The medium picks the tier:
GPU (or none) -> TIER_GPU; CPU, CPU_PINNED, CPU_TIER1 -> TIER_HOST; any other
medium (CPU_TIER2, DISK, STORAGE, EXTERNAL, ...) -> TIER_HOST of a holder of
its own, ``.../dp<rank>/<medium>``, so two host-side media never collide in
one (holder, tier) record.

Each holder keeps a mirror of what it holds (hash -> generation). It is the
truth a Publisher resync re-sends after the directory lost us, and what
AllBlocksCleared / an engine restart withdraws. Generations are the
consumer's applied-batch counter, monotonic for the agent's incarnation, so
a guarded remove never undoes a later store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvdir.agent.events.decode import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    DecodeError,
)
from kvdir.agent.events.hashes import HashFormat, keys
from kvdir.agent.publisher import Holding, NodeIdentity, Publisher, PublisherLimits
from kvdir.core.sharded_client import AnyDirectoryClient
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent.events")

GPU_MEDIA = frozenset({"GPU"})
HOST_MEDIA = frozenset({"CPU", "CPU_PINNED", "CPU_TIER1"})
MIRROR_BLOCKS_MAX = 4_000_000
"""Per holder; past it stores are published but not mirrored (resync misses them)."""


def placement(medium: str | None) -> tuple[str, int]:
    """(holder suffix, tier) of a medium."""
    if medium is None or medium.upper() in GPU_MEDIA:
        return "", pb.TIER_GPU
    if medium.upper() in HOST_MEDIA:
        return "", pb.TIER_HOST
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in medium.lower())
    return safe[:32] or "unnamed", pb.TIER_HOST


def holder_id(node_id: str, engine: str, rank: int, suffix: str = "") -> str:
    base = f"{node_id}/{engine}/dp{rank}"
    return f"{base}/{suffix}" if suffix else base


@dataclass
class Applied:
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    skipped_events: int = 0
    """Well-formed events we do not index (another KV group, block size mismatch)."""
    bad_events: int = 0
    """Events whose hashes could not be normalised."""
    reasons: list[str] = field(default_factory=list)


class _Holder:
    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.lock = threading.Lock()
        self.mirror: dict[int, dict[bytes, int]] = {}


PublisherFactory = Callable[
    [AnyDirectoryClient, NodeIdentity, Callable[[], list[tuple[pb.Namespace, int, list[Holding]]]]],
    Publisher,
]


class IndexHolders:
    """The holders of one engine (all its DP ranks); thread-safe per rank."""

    def __init__(
        self,
        client: AnyDirectoryClient,
        node: NodeIdentity,
        engine: str,
        ns: pb.Namespace,
        hash_format: HashFormat = HashFormat.AUTO,
        kv_group: int = 0,
        limits: PublisherLimits | None = None,
    ) -> None:
        self.client = client
        self.node = node
        self.engine = engine
        self.ns = ns
        self.hash_format = hash_format
        self.kv_group = kv_group
        self.limits = limits or PublisherLimits()
        self._holders: dict[tuple[int, str], _Holder] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ holders

    def holder(self, rank: int, suffix: str = "") -> _Holder:
        """The holder of (rank, medium suffix), registered on first use.

        Raises DirectoryError when the directory cannot register it (the caller
        counts the batch as failed; the next one retries).
        """
        with self._lock:
            h = self._holders.get((rank, suffix))
            if h is not None:
                return h
            ident = NodeIdentity(
                holder_id(self.node.node_id, self.engine, rank, suffix),
                self.node.host,
                "",
                (),
                self.node.lease_ms,
            )
            box: list[_Holder] = []
            pub = Publisher(self.client, ident, lambda: self._holdings(box), self.limits)
            h = _Holder(pub)
            box.append(h)
            pub.start()
            self._holders[(rank, suffix)] = h
            return h

    def _holdings(self, box: list[_Holder]) -> list[tuple[pb.Namespace, int, list[Holding]]]:
        if not box:
            return []
        h = box[0]
        with h.lock:
            return [
                (self.ns, tier, [(k, 0, 0, 0, g) for k, g in m.items()])
                for tier, m in h.mirror.items()
                if m
            ]

    def publishers(self) -> list[Publisher]:
        with self._lock:
            return [h.publisher for h in self._holders.values()]

    def holder_ids(self) -> list[str]:
        with self._lock:
            return [h.publisher.node.node_id for h in self._holders.values()]

    def stop(self, deregister: bool = True) -> None:
        for p in self.publishers():
            p.stop(deregister=deregister)

    # ------------------------------------------------------------- apply

    def apply(self, rank: int, batch: Batch, generation: int) -> Applied:
        """Apply one batch's events in order (the caller serialises per rank)."""
        out = Applied()
        for ev in batch.events:
            if type(ev) is BlockStored:
                if not self._indexed(ev.group_idx, ev.block_size, out):
                    continue
                self._store(rank, ev.medium, ev.hashes, generation, out)
            elif type(ev) is BlockRemoved:
                if ev.group_idx is not None and ev.group_idx != self.kv_group:
                    out.skipped_events += 1
                    continue
                self._remove(rank, ev.medium, ev.hashes, generation, out)
            elif type(ev) is AllBlocksCleared:
                self.clear(rank, generation)
                out.clears += 1
        return out

    def _indexed(self, group: int | None, block_size: int, out: Applied) -> bool:
        if group is not None and group != self.kv_group:
            out.skipped_events += 1
            return False
        if block_size != self.ns.block_tokens:
            out.skipped_events += 1
            out.reasons.append(
                f"block_size {block_size} != the namespace's block_tokens {self.ns.block_tokens}"
            )
            return False
        return True

    def _keys(self, hashes: Sequence[int | bytes], out: Applied) -> list[bytes] | None:
        try:
            return keys(hashes, self.hash_format)
        except DecodeError as e:
            out.bad_events += 1
            out.reasons.append(str(e))
            return None

    def _store(
        self,
        rank: int,
        medium: str | None,
        hashes: Sequence[int | bytes],
        gen: int,
        out: Applied,
    ) -> None:
        ks = self._keys(hashes, out)
        if not ks:
            return
        suffix, tier = placement(medium)
        h = self.holder(rank, suffix)
        with h.lock:
            m = h.mirror.setdefault(tier, {})
            if len(m) + len(ks) <= MIRROR_BLOCKS_MAX:
                m.update(dict.fromkeys(ks, gen))
        n = len(ks)
        zeros = [0] * n
        h.publisher.stored(self.ns, tier, ks, zeros, zeros, zeros, [gen] * n)
        out.stored_blocks += n

    def _remove(
        self,
        rank: int,
        medium: str | None,
        hashes: Sequence[int | bytes],
        gen: int,
        out: Applied,
    ) -> None:
        ks = self._keys(hashes, out)
        if not ks:
            return
        suffix, tier = placement(medium)
        h = self.holder(rank, suffix)
        with h.lock:
            m = h.mirror.get(tier)
            if m:
                for k in ks:
                    m.pop(k, None)
        n = len(ks)
        h.publisher.removed(self.ns, tier, ks, [gen] * n, [0] * n)
        out.removed_blocks += n

    def clear(self, rank: int, generation: int) -> int:
        """Withdraw everything rank `rank` holds, in every medium (ordered after
        the changes already queued, since it goes through the same queues)."""
        with self._lock:
            mine = [h for (r, _), h in self._holders.items() if r == rank]
        withdrawn = 0
        for h in mine:
            with h.lock:
                mirror, h.mirror = h.mirror, {}
            for tier, m in mirror.items():
                ks = list(m)
                if ks:
                    n = len(ks)
                    h.publisher.removed(self.ns, tier, ks, [generation] * n, [0] * n)
                    withdrawn += n
        log.info(
            "engine cache cleared",
            extra={"engine": self.engine, "rank": rank, "withdrawn": withdrawn},
        )
        return withdrawn
