"""The fetch path: find a holder, pull its blocks into our slots, validate.

1. Directory lookup of the chain (local read), excluding ourselves.
2. Holder choice: longest prefix; among equals same host first (shm), then a
   random one (spreads load); peers that failed recently are skipped.
3. One batched transfer of every needed block straight into the caller's
   slots, *then* one batched read of the holder's slot headers.
4. Validation (required: a one-sided read gives the holder no chance to
   refuse): block i is valid only if the holder's header still says STORED,
   the hash is chain[i] and the generation is the one the directory published.
   The first invalid block ends the valid prefix; partial success is normal.

`after_data` is a test hook run between the data and the header reads, so a
test can make an eviction race a fetch deterministically.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from kvdir.agent.pool import HEADER_BYTES, KvPool, valid_prefix
from kvdir.core.client import DirectoryClient, DirectoryError, records
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.wire import AGENT_WIRE_VERSION, BadNamespace, namespace_key
from kvdir.transfer.base import Channel, Read, TransferError
from kvdir.transfer.engine import Descriptor, TransferEngine
from kvdir.transfer.shm import host_identity
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent.fetch")

PEER_COOLDOWN_S = 5.0
HOLDERS_TRIED_MAX = 3
HANDSHAKE_TIMEOUT_S = 2.0


def _pools_by_key(pools: Iterable[apb.PoolInfo]) -> dict[str, apb.PoolInfo]:
    """A peer's pools by namespace key; one it describes malformed is left out."""
    out: dict[str, apb.PoolInfo] = {}
    for p in pools:
        try:
            out[namespace_key(p.namespace)] = p
        except BadNamespace:
            continue
    return out


class FetchError(ValueError):
    """The request itself is wrong (bad slots, unknown namespace)."""


@dataclass(slots=True)
class FetchResult:
    valid_blocks: int = 0
    source_node: str = ""
    transport: str = ""
    bytes: int = 0
    invalidated: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class Peer:
    node_id: str
    incarnation: int
    same_host: bool
    pools: dict[str, apb.PoolInfo]
    transport: str
    channel: Channel


@dataclass(slots=True)
class PeerCache:
    """Handshaken peers by (node id, endpoint), and peers in cooldown."""

    engine: TransferEngine
    self_node: str
    security: ClientSecurity = PLAIN
    """How to reach peers' kvdir.v1.Agent (TLS with our node certificate when set)."""
    peers: dict[tuple[str, str], Peer] = field(default_factory=dict)
    cooldown: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def healthy(self, node_id: str) -> bool:
        return self.cooldown.get(node_id, 0.0) <= time.monotonic()

    def fail(self, node_id: str, endpoint: str) -> None:
        with self.lock:
            self.cooldown[node_id] = time.monotonic() + PEER_COOLDOWN_S
            peer = self.peers.pop((node_id, endpoint), None)
        if peer is not None:
            peer.channel.close()

    def close(self) -> None:
        """Close every cached channel (agent shutdown)."""
        with self.lock:
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.channel.close()

    def get(self, node_id: str, endpoint: str) -> Peer:
        with self.lock:
            peer = self.peers.get((node_id, endpoint))
        if peer is not None:
            return peer
        peer = self._handshake(node_id, endpoint)
        with self.lock:
            self.peers[(node_id, endpoint)] = peer
        return peer

    def _handshake(self, node_id: str, endpoint: str) -> Peer:
        with self.security.channel(endpoint) as ch:
            try:
                resp = apb_grpc.AgentStub(ch).Handshake(
                    apb.HandshakeRequest(
                        version=AGENT_WIRE_VERSION,
                        node_id=self.self_node,
                        transports=self.engine.names,
                    ),
                    timeout=HANDSHAKE_TIMEOUT_S,
                )
            except grpc.RpcError as e:
                raise TransferError(
                    f"handshake with {node_id} at {endpoint} failed: {e.code().name}"
                ) from e
        if resp.node_id != node_id:
            raise TransferError(f"{endpoint} is {resp.node_id!r}, not {node_id!r}")
        offered = [Descriptor(t.name, dict(t.params)) for t in resp.transports]
        name, channel = self.engine.open_channel(offered)
        same_host = any(d.params.get("host_id") == host_identity() for d in offered)
        pools = _pools_by_key(resp.pools)
        return Peer(
            node_id,
            resp.incarnation,
            same_host,
            pools,
            name,
            channel,
        )


class Fetcher:
    def __init__(
        self,
        node_id: str,
        directory: DirectoryClient,
        peers: PeerCache,
        rng: random.Random | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.node_id = node_id
        self.directory = directory
        self.peers = peers
        self.rng = rng or random.Random()
        self.timeout_s = timeout_s
        self.after_data: Callable[[], None] | None = None
        self.validation_failures = 0

    def fetch(
        self,
        ns: pb.Namespace,
        pool: KvPool,
        chain: list[bytes],
        slots: list[int],
        timeout_s: float | None = None,
        skip: int = 0,
    ) -> FetchResult:
        """Pull chain[skip:] into `slots` (the caller holds chain[:skip] already;
        the lookup still matches the whole chain from block 0)."""
        if not 0 <= skip <= len(chain):
            raise FetchError(f"skip_blocks {skip} outside the chain of {len(chain)} blocks")
        if len(chain) - skip != len(slots):
            raise FetchError(f"{len(chain) - skip} blocks but {len(slots)} destination slots")
        for s in slots:
            pool.check_slot(s)
        if len(set(slots)) != len(slots):
            raise FetchError("destination slots repeat")
        t0 = time.perf_counter()
        deadline = t0 + (timeout_s or self.timeout_s)
        try:
            resp = self.directory.lookup(ns, chain, exclude_node=self.node_id, max_nodes=8)
        except DirectoryError as e:
            log.warning("lookup for fetch failed", extra={"error": str(e)})
            return FetchResult(seconds=time.perf_counter() - t0)
        result = FetchResult()
        for match in self._candidates(resp.matches)[:HOLDERS_TRIED_MAX]:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                result = self._pull(ns, pool, chain, slots, match, left, skip)
                break
            except (TransferError, OSError) as e:
                log.warning(
                    "fetch from peer failed", extra={"peer": match.node_id, "error": str(e)}
                )
                self.peers.fail(match.node_id, match.agent_endpoint)
        result.seconds = time.perf_counter() - t0
        return result

    def _candidates(self, matches: Sequence[pb.NodeMatch]) -> list[pb.NodeMatch]:
        usable = [
            m
            for m in matches
            if m.prefix_blocks > 0
            and m.agent_endpoint
            and self.peers.healthy(m.node_id)
            and m.addresses
        ]
        keyed = [
            (-m.prefix_blocks, "shm" not in m.transports, self.rng.random(), i)
            for i, m in enumerate(usable)
        ]
        return [usable[k[3]] for k in sorted(keyed)]

    def _pull(
        self,
        ns: pb.Namespace,
        pool: KvPool,
        chain: list[bytes],
        slots: list[int],
        match: pb.NodeMatch,
        timeout_s: float,
        skip: int = 0,
    ) -> FetchResult:
        peer = self.peers.get(match.node_id, match.agent_endpoint)
        info = peer.pools.get(namespace_key(ns))
        if info is None:
            raise TransferError(f"{peer.node_id} has no pool for this namespace")
        rec = records(match)
        n = min(match.prefix_blocks, len(chain))
        slot_bytes = pool.geometry.slot_bytes
        data, headers = [], []
        for i in range(skip, n):
            length = rec.lengths[i]
            if length > slot_bytes:
                n = i  # the holder's block does not fit our slot: stop the prefix here
                break
            dst = pool.data_offset(slots[i - skip])
            data.append(Read(rec.addresses[i], rec.rkeys[i], length, dst))
            remote_slot = (rec.addresses[i] - info.data_address) // info.slot_bytes
            headers.append(
                Read(
                    info.header_address + remote_slot * HEADER_BYTES,
                    rec.rkeys[i],
                    HEADER_BYTES,
                    (i - skip) * HEADER_BYTES,
                )
            )
        if n <= skip:
            return FetchResult(source_node=peer.node_id, transport=peer.transport)
        t_end = time.perf_counter() + timeout_s
        moved = peer.channel.read(data, pool.view, timeout_s)
        if self.after_data is not None:
            self.after_data()
        scratch = bytearray((n - skip) * HEADER_BYTES)
        peer.channel.read(headers, memoryview(scratch), max(0.001, t_end - time.perf_counter()))
        valid = valid_prefix(scratch, chain[skip:n], rec.generations[skip:n])
        invalid = n - skip - valid
        if invalid:
            self.validation_failures += 1
        return FetchResult(valid, peer.node_id, peer.transport, moved, invalid)
