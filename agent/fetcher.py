"""The fetch path: find a holder, pull its blocks into our slots, validate.

1. Directory lookup of the chain (local read), excluding ourselves: from the
   agent's in-process mirror while it is fresh, else a replica
   (agent/directory_reads.py). A fetch that brings a load ticket (the
   holders the engine's own lookup found, agent/tickets.py) skips this step:
   one directory lookup per load.
2. Holder choice (agent/holders.py): longest prefix, then the cheapest path
   (same-host GPU over CUDA IPC, remote GPU (unverified, behind a flag), the
   holder's host copy), then same host, then random; peers that failed
   recently are skipped.
3. One batched transfer of every needed block straight into the caller's
   slots (host slots, or the slots of our GPU tier: one kernel), *then* one
   batched read of the holder's slot headers (host memory, whatever the tier).
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
import numpy as np

from kvdir.agent import holders
from kvdir.agent.directory_reads import DirectoryReads, read_holders
from kvdir.agent.gpu_pool import GpuTier, slots_of
from kvdir.agent.limits import HOLDERS_TRIED_MAX
from kvdir.agent.pool import HEADER_BYTES, KvPool, valid_prefix
from kvdir.core.client import DirectoryError
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.wire import AGENT_WIRE_VERSION, BadNamespace, namespace_key
from kvdir.transfer.base import Channel, CopyTimedOut, Read, TransferError, block_reads
from kvdir.transfer.engine import Descriptor, TransferEngine
from kvdir.transfer.shm import host_identity
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent.fetch")

PEER_COOLDOWN_S = 5.0
LOOKUP_NODES_MAX = 8
"""Holders one fetch's (or the engine's) directory lookup asks for, records included."""
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
    path: str = ""
    """holders.CUDA, holders.HOST, ... (empty when nothing was read)."""
    read_seconds: float = 0.0
    """From the first byte read to validated (the data path, without the lookup)."""
    slots_retired: bool = False
    """A device read into the slots timed out and may still land: valid_blocks is 0 and
    the caller must never use the slots again (FetchResponse.slots_retired)."""


@dataclass(slots=True)
class Peer:
    node_id: str
    incarnation: int
    same_host: bool
    pools: dict[str, apb.PoolInfo]
    transport: str
    channel: Channel
    device_channel: Channel | None = None
    """The peer's GPU regions (cuda transport), when both sides have it on one host."""

    def close(self) -> None:
        self.channel.close()
        if self.device_channel is not None:
            self.device_channel.close()


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
    closed: bool = False

    def healthy(self, node_id: str) -> bool:
        return self.cooldown.get(node_id, 0.0) <= time.monotonic()

    def fail(self, node_id: str, endpoint: str) -> None:
        with self.lock:
            self.cooldown[node_id] = time.monotonic() + PEER_COOLDOWN_S
            peer = self.peers.pop((node_id, endpoint), None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        """Close every cached channel (agent shutdown); later gets are refused."""
        with self.lock:
            self.closed = True
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.close()

    def cached(self, node_id: str, endpoint: str) -> Peer | None:
        """The peer if already handshaken (never a round trip)."""
        with self.lock:
            return self.peers.get((node_id, endpoint))

    def get(self, node_id: str, endpoint: str) -> Peer:
        """The cached peer, else a fresh handshake. The handshake runs outside
        the lock (it is a network round trip), so two fetches can race to it:
        the first stored wins and the other's channel is closed, never dropped
        open. A fetch still running when the agent stops closes its own."""
        key = (node_id, endpoint)
        with self.lock:
            peer = self.peers.get(key)
        if peer is not None:
            return peer
        fresh = self._handshake(node_id, endpoint)
        with self.lock:
            kept = None if self.closed else self.peers.setdefault(key, fresh)
        if kept is not fresh:
            fresh.close()
        if kept is None:
            raise TransferError(f"not fetching from {node_id}: the agent is stopping")
        return kept

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
        device: Channel | None = None
        if same_host and "cuda" in self.engine.transports:
            try:
                device = self.engine.open_device_channel(offered)
            except TransferError:
                device = None  # no GPU regions offered: the host path serves
        return Peer(node_id, resp.incarnation, same_host, pools, name, channel, device)


class Fetcher:
    def __init__(
        self,
        node_id: str,
        directory: DirectoryReads,
        peers: PeerCache,
        rng: random.Random | None = None,
        timeout_s: float = 5.0,
        host: str = "",
        rdma_gpu: bool = False,
    ) -> None:
        """`host`: the address this agent publishes (same-host holders share it);
        `rdma_gpu`: allow the unverified remote-GPU path in holder choice."""
        self.node_id = node_id
        self.host = host
        self.rdma_gpu = rdma_gpu
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
        gpu: GpuTier | None = None,
        skip: int = 0,
        ticket_holders: Sequence[holders.Holder] | None = None,
    ) -> FetchResult:
        """Pull chain[skip:] into `slots` of `pool` (the caller holds chain[:skip]
        already; the lookup still matches the whole chain from block 0). With `gpu`,
        into its GPU tier: the slots' KV then lives in device memory. With
        `ticket_holders` (a load ticket's, best first), read from them without a lookup."""
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
        # The answer may come from a mirror up to directory_mirror_staleness_ms behind
        # (or a lagging follower): it can name a holder whose slot has been evicted or
        # reused since. That costs a miss only: `_pull` reads the holder's slot headers
        # *after* the data and `valid_prefix` keeps a block only if its header is still
        # STORED with this hash and the generation the answer carries; a reused slot
        # has a newer generation, so its bytes are never reported valid.
        matches = ticket_holders
        if matches is None:
            try:
                matches = read_holders(
                    self.directory, ns, chain, LOOKUP_NODES_MAX, exclude_node=self.node_id
                )
            except DirectoryError as e:
                log.warning("lookup for fetch failed", extra={"error": str(e)})
                return FetchResult(seconds=time.perf_counter() - t0)
        result = FetchResult()
        for cand in self.candidates(matches, gpu is not None)[:HOLDERS_TRIED_MAX]:
            match = cand.match
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                result = self._pull(ns, pool, chain, slots, cand, left, gpu, skip)
                break
            except (TransferError, OSError) as e:
                log.warning(
                    "fetch from peer failed", extra={"peer": match.node_id, "error": str(e)}
                )
                self.peers.fail(match.node_id, match.agent_endpoint)
                if isinstance(e, CopyTimedOut):
                    # That kernel may still write these slots after any later read (or
                    # the caller's own writes) landed: no other holder is tried into
                    # them, and the caller retires them.
                    result = FetchResult(slots_retired=True)
                    break
        result.seconds = time.perf_counter() - t0
        return result

    def candidates(
        self, matches: Sequence[holders.Holder], gpu_pool: bool
    ) -> list[holders.Candidate]:
        """Usable holders among `matches`, best first (what a fetch tries, in order)."""
        reader = holders.Reader(
            self.host, gpu_pool, "cuda" in self.peers.engine.transports, self.rdma_gpu
        )
        healthy = [self.peers.healthy(m.node_id) for m in matches]
        return holders.rank(matches, reader, healthy, self.rng)

    def read_over(self, cand: holders.Candidate) -> str:
        """What a fetch from `cand` would read over: its device path ("cuda",
        "rdma-gpu"), or for the host path the transport of the channel already
        open to that peer ("shm", "tcp", "rdma"); "host" before the first fetch
        opened one (no round trip is made here to learn it)."""
        if cand.path != holders.HOST:
            return cand.path
        peer = self.peers.cached(cand.match.node_id, cand.match.agent_endpoint)
        return peer.transport if peer is not None else holders.HOST

    def _pull(
        self,
        ns: pb.Namespace,
        pool: KvPool,
        chain: list[bytes],
        slots: list[int],
        cand: holders.Candidate,
        timeout_s: float,
        gpu: GpuTier | None,
        skip: int = 0,
    ) -> FetchResult:
        match = cand.match
        peer = self.peers.get(match.node_id, match.agent_endpoint)
        info = peer.pools.get(namespace_key(ns))
        if info is None:
            raise TransferError(f"{peer.node_id} has no pool for this namespace")
        full = _sources(info, match, min(cand.blocks, len(chain)), pool.geometry.slot_bytes)
        n = len(full.addresses)
        src = full.tail(skip)
        path = cand.path
        if path == holders.CUDA and (peer.device_channel is None or gpu is None):
            path = holders.HOST  # the handshake found no GPU regions we can map
        transport = "cuda" if path == holders.CUDA else peer.transport
        if n <= skip:
            return FetchResult(source_node=peer.node_id, transport=transport, path=path)
        t_read = time.perf_counter()
        t_end = t_read + timeout_s
        if path == holders.CUDA:
            assert gpu is not None and peer.device_channel is not None
            moved = _read_gpu(peer.device_channel, info, match, src, slots, gpu, timeout_s)
        else:  # HOST, and RDMA_GPU until that path is verified (docs/gpu.md)
            m = len(src.host_addresses)
            data = block_reads(
                src.host_addresses,
                [info.rkey] * m if src.gpu else src.rkeys,
                src.lengths,
                [pool.data_offset(s) for s in slots[:m]],
            )
            moved = peer.channel.read(data, pool.view, timeout_s)
        if self.after_data is not None:
            self.after_data()
        left = max(0.001, t_end - time.perf_counter())
        headers = _headers(peer.channel, info, src, left)
        valid = valid_prefix(headers, chain[skip:n], src.generations)
        if gpu is not None and path != holders.CUDA and valid:
            gpu.upload(slots[:valid], max(0.001, t_end - time.perf_counter()))
        invalid = n - skip - valid
        if invalid:
            self.validation_failures += 1
        return FetchResult(
            valid, peer.node_id, transport, moved, invalid, path=path,
            read_seconds=time.perf_counter() - t_read,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Sources:
    """Where the leading blocks of a holder's prefix are: their published records,
    and the host copy and header of each (derived from the holder's pool geometry)."""

    gpu: bool
    addresses: list[int]
    rkeys: list[int]
    lengths: list[int]
    generations: list[int]
    host_addresses: list[int]
    header_addresses: list[int]
    header_rkey: int
    """Headers live in the holder's host pool (its rkey), whatever the data's tier."""

    def tail(self, skip: int) -> _Sources:
        """The blocks from `skip` on (the reader holds the first `skip` already)."""
        return _Sources(
            self.gpu, self.addresses[skip:], self.rkeys[skip:], self.lengths[skip:],
            self.generations[skip:], self.host_addresses[skip:], self.header_addresses[skip:],
            self.header_rkey,
        )  # fmt: skip


def record_slot(
    info: apb.PoolInfo, address: int, length: int, slot_bytes: int, gpu: bool = False
) -> int:
    """The holder's slot a directory record names, or -1 if it is not one whole slot.

    A record is what some agent published; before reading `length` bytes into
    one of our slots, check that it is exactly one slot of the pool the holder
    describes and of ours (every block of a namespace is one slot): not 0
    bytes, not a part or more than a slot, not an address off the slot grid or
    outside the pool.
    """
    addresses = np.asarray([address], np.uint64)
    return int(record_slots(info, addresses, np.asarray([length], np.uint64), slot_bytes, gpu)[0])


def record_slots(
    info: apb.PoolInfo,
    addresses: np.ndarray,
    lengths: np.ndarray,
    slot_bytes: int,
    gpu: bool = False,
) -> np.ndarray:
    """`record_slot` of every record at once (int64; -1 where a record is not one
    whole slot): a 512-block fetch checks its records in microseconds, not a
    Python loop's milliseconds."""
    sb = int(info.slot_bytes)
    if slot_bytes != sb:
        return np.full(len(addresses), -1, np.int64)
    base = info.gpu_address if gpu else info.data_address
    slots = slots_of(base, sb, info.slots, addresses)
    return np.where(lengths.astype(np.uint64, copy=False) == np.uint64(sb), slots, -1)


def _column(data: bytes, dtype: str, n: int) -> np.ndarray:
    """The first `n` values of a packed little-endian record column (fewer if short)."""
    width = np.dtype(dtype).itemsize
    return np.frombuffer(data, dtype, min(n, len(data) // width))


def _sources(info: apb.PoolInfo, match: holders.Holder, n: int, slot_bytes: int) -> _Sources:
    """The first `n` blocks of `match` as reads; the prefix stops at the first record
    that is not exactly one whole slot of the holder's pool and of ours (or where a
    column ends: a record is whole or not read)."""
    n = min(n, match.prefix_blocks)
    addresses, lengths = _column(match.addresses, "<u8", n), _column(match.lengths, "<u4", n)
    rkeys, gens = _column(match.rkeys, "<u4", n), _column(match.generations, "<u8", n)
    gpu = bool(match.tiers) and match.tiers[0] == pb.TIER_GPU and info.gpu_rkey != 0
    m = min(len(addresses), len(lengths), len(rkeys), len(gens))
    slots = record_slots(info, addresses[:m], lengths[:m], slot_bytes, gpu)
    bad = np.flatnonzero(slots < 0)
    k = int(bad[0]) if len(bad) else m
    slots = slots[:k].astype(np.uint64)
    sb, hb = np.uint64(info.slot_bytes), np.uint64(HEADER_BYTES)
    host = np.uint64(info.data_address) + slots * sb if gpu else addresses[:k]
    return _Sources(
        gpu, addresses[:k].tolist(), rkeys[:k].tolist(), lengths[:k].tolist(),
        gens[:k].tolist(), host.tolist(), (np.uint64(info.header_address) + slots * hb).tolist(),
        info.rkey,
    )  # fmt: skip


HEADER_SPAN_FACTOR_MAX = 8
"""Read the headers as one span when it is at most this many times their bytes."""


def _headers(channel: Channel, info: apb.PoolInfo, src: _Sources, timeout_s: float) -> bytes:
    """The holder's headers of `src`'s blocks, in block order, read *after* the data.

    Blocks sit in scattered slots; one read of the span that covers them (a few
    KiB for thousands of blocks) costs less than a read per 64-byte header."""
    addrs = np.asarray(src.header_addresses, np.int64)
    lo, hi = int(addrs.min()), int(addrs.max()) + HEADER_BYTES
    n = len(addrs)
    if hi - lo <= HEADER_SPAN_FACTOR_MAX * n * HEADER_BYTES:
        span = bytearray(hi - lo)
        channel.read([Read(lo, src.header_rkey, hi - lo, 0)], memoryview(span), timeout_s)
        rows = np.frombuffer(span, np.uint8).reshape(-1, HEADER_BYTES)
        return rows[(addrs - lo) // HEADER_BYTES].tobytes()
    reads = [Read(a, src.header_rkey, HEADER_BYTES, i * HEADER_BYTES) for i, a in enumerate(addrs)]
    scratch = bytearray(n * HEADER_BYTES)
    channel.read(reads, memoryview(scratch), timeout_s)
    return bytes(scratch)


def _read_gpu(
    channel: Channel,
    info: apb.PoolInfo,
    match: holders.Holder,
    src: _Sources,
    slots: list[int],
    gpu: GpuTier,
    timeout_s: float,
) -> int:
    """The holder's GPU slots straight into our GPU tier's `slots`: one kernel."""
    from kvdir.transfer.cuda_ipc import CudaIpcChannel

    if not src.gpu or not isinstance(channel, CudaIpcChannel):
        raise TransferError(f"{match.node_id}'s records are not GPU regions we can map")
    n = len(src.addresses)
    # _sources kept only records that are whole slots of the holder's tier.
    ids = slots_of(
        info.gpu_address, info.slot_bytes, info.slots, np.asarray(src.addresses, np.uint64)
    )
    pointer = channel.device_pointer(info.gpu_rkey, gpu.device)
    return gpu.read_slots(pointer, info.slot_bytes, info.slots, ids, slots[:n], timeout_s)
