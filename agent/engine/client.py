"""The engine-facing library: what an inference engine on this node links.

It talks to the local agent over its Unix socket (`kvdir.v1.Engine`) and maps
the agent's pool files read-write, so KV bytes never cross a socket: the
engine writes a block's KV into a slot it allocated, then calls `stored`.

`stored` and `removed` must not slow the engine down (target: p99 <= 20 us
on the caller's thread). They update the slot header in shared memory (the
truth the agent re-publishes from) and append to a bounded in-process queue;
a background thread ships the queue to the agent in batches. When the queue
is full a notification is dropped and counted; the agent's periodic resync
from the headers repairs it.

Epochs (agent/pool.py). Each mapping is of one pool epoch; every request that
names slots carries it and every answer's epoch is checked. An agent that
replaced the pool file (restarted with another shape, or a GPU tier) refuses
the old epoch, and the call raises PoolChanged: the caller's slots and this
client's mapping of that pool mean nothing any more; close the client and
attach again. The old mapping stays valid memory (the file was replaced, not
truncated), so a late copy through it reads stale bytes, never faults.
Slots this process allocates are recorded as its own (by pid) and reclaimed
by the agent once the process is gone.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvdir.agent.pool import STALE_EPOCH, STORED, Geometry, KvPool
from kvdir.agent.pool_file import fits, read_superblock
from kvdir.core.wire import (
    FRAME_FETCH,
    FRAME_LOOKUP,
    FRAME_METHOD_SHIFT,
    FRAME_TOO_LONG,
    FRAME_UNKNOWN_METHOD,
    LOOKUP_ANSWER_HEADER,
    LOOKUP_REQUEST_HEADER,
    LOOKUP_SOCKET_SUFFIX,
    namespace_key,
    recv_exactly,
)
from kvdir.transfer.memory import SharedMemory
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

QUEUE_MAX = 65_536
SHIP_BATCH_MAX = 4_096
SHIP_INTERVAL_S = 0.002


class EngineError(Exception):
    """The agent refused a request (the message says why) or is unreachable."""


class PoolChanged(EngineError):
    """The agent serves another epoch of this pool than the one mapped here."""


class Refused(EngineError):
    """The agent refused this request as invalid (INVALID_ARGUMENT: the message says
    why), e.g. a load ticket it did not issue; the agent itself is fine."""


@dataclass(frozen=True, slots=True)
class Allocation:
    slots: list[int]
    generations: list[int]


_Item = tuple[str, bool, tuple[bytes, ...], tuple[int, ...], list[int]]
"""(namespace key, stored?, hashes, slots, generations) of one stored/removed call."""


def _key(ns: pb.Namespace) -> str:
    return namespace_key(ns)


class _AttachedPool:
    """The engine's read-write view of one agent pool (one epoch of it)."""

    def __init__(self, info: apb.PoolInfo) -> None:
        self.info = info
        self.epoch = info.epoch
        geo = Geometry.of(info.slot_bytes, info.slots)
        mem = SharedMemory.open_readwrite(info.path, owner=False)
        # The file may have been replaced since the agent answered: map it only
        # if it is the epoch and shape described (a smaller file faults on use).
        sb = read_superblock(mem.mm)
        if sb is None or sb.retired or sb.epoch != info.epoch or not fits(sb, geo, mem.size):
            mem.close(unlink=False)
            raise PoolChanged(f"the pool file {info.path} changed while attaching")
        self.pool = KvPool(mem, geo, "")

    def current(self) -> bool:
        """The agent still serves this mapping's file (not replaced since attach)."""
        return not self.pool.retired and self.pool.epoch == self.epoch


def _error(method: str, code: grpc.StatusCode, details: str) -> EngineError:
    """The exception of an agent's refusal (over gRPC or the lookup socket)."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(STALE_EPOCH):
        return PoolChanged(f"{method}: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Refused(f"{method}: {details}")
    return EngineError(f"{method}: {details}")


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _LookupSocket:
    """Each thread's connection to the agent's lookup socket (agent/lookup_socket.py):
    a lookup or a fetch is one frame each way, with no gRPC on either side. `ask`
    answers None when the agent has no such socket or closed it unanswered (an
    older agent, or one at its connection bound), and a fetch None when the agent
    takes no fetch frames: the caller then asks over gRPC."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.fallbacks = 0
        self.fetch_frames = True
        """False once the agent refused a fetch frame (wire.FRAME_TOO_LONG: an agent from
        before them; FRAME_UNKNOWN_METHOD): fetches go over gRPC from then on."""

    def ask(
        self, req: apb.EngineLookupRequest, timeout_s: float
    ) -> apb.EngineLookupResponse | None:
        payload = self._frame(FRAME_LOOKUP, "Lookup", req.SerializeToString(), timeout_s)
        return None if payload is None else apb.EngineLookupResponse.FromString(payload)

    def fetch(self, req: apb.FetchRequest, timeout_s: float) -> apb.FetchResponse | None:
        if not self.fetch_frames:
            return None
        try:
            payload = self._frame(FRAME_FETCH, "Fetch", req.SerializeToString(), timeout_s)
        except Refused as e:
            if not str(e).startswith(
                (f"Fetch: {FRAME_TOO_LONG}", f"Fetch: {FRAME_UNKNOWN_METHOD}")
            ):
                raise
            # An agent from before fetch frames (it closed this connection: _frame dropped
            # it), or one that serves none.
            self.fetch_frames = False
            return None
        return None if payload is None else apb.FetchResponse.FromString(payload)

    def _frame(self, method: int, name: str, body: bytes, timeout_s: float) -> bytes | None:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout_s)
                sock.connect(self.path)
            except OSError:
                sock.close()
                self.fallbacks += 1
                return None
            self._local.sock = sock
            with self._lock:
                self._open.add(sock)
        header = LOOKUP_REQUEST_HEADER.pack(method << FRAME_METHOD_SHIFT | len(body))
        try:
            sock.settimeout(timeout_s)
            sock.sendall(header + body)
            code, length = LOOKUP_ANSWER_HEADER.unpack(_read(sock, LOOKUP_ANSWER_HEADER.size))
            payload = _read(sock, length)
        except OSError as e:
            # Timed out or cut: an answer may still come, so this connection's stream
            # is out of step; the next call on this thread opens another.
            self._drop(sock)
            if isinstance(e, ConnectionError):
                self.fallbacks += 1
                return None  # closed unanswered: the agent at its bound, or going away
            raise EngineError(f"{name}: {e or type(e).__name__}") from e
        if code != grpc.StatusCode.OK.value[0]:
            message = payload.decode(errors="replace")
            if message.startswith(FRAME_TOO_LONG):
                self._drop(sock)  # the agent closes the connection after this refusal
            status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
            raise _error(name, status, message)
        return payload

    def _drop(self, sock: socket.socket) -> None:
        self._local.sock = None
        with self._lock:
            self._open.discard(sock)
        sock.close()

    def close(self) -> None:
        """Every thread's connection (the client is closing)."""
        with self._lock:
            socks, self._open = list(self._open), set()
        for sock in socks:
            sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    got = recv_exactly(sock, n)
    if got is None:
        raise ConnectionError("the agent closed the lookup socket unanswered")
    return got


class EngineClient:
    def __init__(
        self, socket_path: str, timeout_s: float = 10.0, lookup_socket: bool = True
    ) -> None:
        """`lookup_socket`: ask lookups over the agent's lookup socket (gRPC when the
        agent has none); False: always gRPC."""
        self._lookups = _LookupSocket(socket_path + LOOKUP_SOCKET_SUFFIX) if lookup_socket else None
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = apb_grpc.EngineStub(self._channel)
        self.timeout_s = timeout_s
        self.pid = os.getpid()
        try:
            resp = self._stub.Attach(apb.AttachRequest(pid=self.pid), timeout=timeout_s)
        except grpc.RpcError as e:
            self._channel.close()
            raise EngineError(
                f"cannot attach to the agent at {socket_path}: {e.code().name}"
            ) from e
        self.node_id = resp.node_id
        self.pools: dict[str, _AttachedPool] = {}
        try:
            for p in resp.pools:
                self.pools[_key(p.namespace)] = _AttachedPool(p)
        except (PoolChanged, OSError, ValueError) as e:
            self._unmap()
            self._channel.close()
            raise PoolChanged(f"cannot map the agent's pools: {e}") from e
        self.device_transports = {t.name: dict(t.params) for t in resp.transports}
        """The agent's cuda descriptor, when it has GPU pools (agent/engine/gpu_kv.py maps them)."""
        self._queue: deque[_Item] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dropped = 0
        self._unreported_drops = 0
        self._shipper = threading.Thread(
            target=self._ship_loop, name="kvdir-engine-notify", daemon=True
        )
        self._shipper.start()

    # ------------------------------------------------------------- helpers

    def _pool(self, ns: pb.Namespace, key: str | None = None) -> _AttachedPool:
        p = self.pools.get(_key(ns) if key is None else key)
        if p is None:
            raise EngineError(f"the agent has no pool for namespace {ns.model!r}")
        return p

    def _call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _error(method, e.code(), e.details() or e.code().name) from e

    @staticmethod
    def _check_epoch(method: str, pool: _AttachedPool, epoch: int) -> None:
        """An answer about another epoch than the mapped one is not ours to use."""
        if epoch != pool.epoch:
            raise PoolChanged(
                f"{method}: the agent answered for pool epoch {epoch:#x}, "
                f"this engine maps {pool.epoch:#x}"
            )

    def current(self, ns: pb.Namespace) -> bool:
        """This namespace's mapping is still the agent's pool file (re-check after a failure)."""
        p = self.pools.get(_key(ns))
        return p is not None and p.current()

    def slot_view(self, ns: pb.Namespace, slot: int) -> memoryview:
        """Read-write bytes of one slot (write KV here before `stored`)."""
        pool = self._pool(ns).pool
        pool.check_slot(slot)
        return pool.slot_view(slot)

    # ------------------------------------------------------------ slots

    def allocate(self, ns: pb.Namespace, count: int, evict: bool = False) -> Allocation:
        """`count` slots (all or nothing); with `evict`, least recently used stored
        blocks make up for missing free slots and fewer may come back."""
        pool = self._pool(ns)
        req = apb.AllocateRequest(
            namespace=ns, count=count, evict=evict, epoch=pool.epoch, pid=self.pid
        )
        resp = self._call("Allocate", req)
        assert isinstance(resp, apb.AllocateResponse)
        self._check_epoch("Allocate", pool, resp.epoch)
        return Allocation(list(resp.slots), list(resp.generations))

    def free(self, ns: pb.Namespace, slots: Sequence[int]) -> int:
        self.flush()  # notifications about these slots go first
        req = apb.FreeRequest(namespace=ns, slots=slots, epoch=self._pool(ns).epoch)
        resp = self._call("Free", req)
        assert isinstance(resp, apb.FreeResponse)
        return resp.freed

    # ---------------------------------------------------------- notifications

    def _enqueue(self, item: _Item) -> bool:
        if len(self._queue) >= QUEUE_MAX:
            self.dropped += len(item[2])
            self._unreported_drops += len(item[2])
            return False
        self._queue.append(item)
        if not self._wake.is_set():
            self._wake.set()
        return True

    def stored(self, ns: pb.Namespace, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """These slots now hold these blocks (their KV is written). Never blocks on I/O.

        The caller's thread only reads each slot's generation and queues one
        item; the shipper thread writes the headers and notifies the agent.
        When the queue is full the headers are written here instead (the
        agent's resync publishes from headers, so nothing is lost).
        """
        key = _key(ns)
        pool = self._pool(ns, key).pool
        if len(hashes) != len(slots):
            raise EngineError(f"{len(hashes)} hashes for {len(slots)} slots")
        item = (key, True, tuple(hashes), tuple(slots), pool.generations(slots))
        if not self._enqueue(item):
            self._mark_stored(pool, item)

    def removed(self, ns: pb.Namespace, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """These slots no longer hold their blocks (evicted; still allocated).

        The generation is bumped here, before this returns, because the engine
        may rewrite the slot right after: a reader must never validate new
        bytes against the old block.
        """
        key = _key(ns)
        pool = self._pool(ns).pool
        hs, ss, gens = [], [], []
        for h, s in zip(hashes, slots, strict=True):
            before = pool.header(s)
            if before.state == STORED and before.block_hash != h:
                continue
            pool.evict(s)
            hs.append(h)
            ss.append(s)
            gens.append(before.generation)
        if hs:
            self._enqueue((key, False, tuple(hs), tuple(ss), gens))

    @staticmethod
    def _mark_stored(pool: KvPool, item: _Item) -> list[int]:
        """Write STORED headers for an item; indexes of the blocks still current."""
        _, _, hashes, slots, gens = item
        return pool.mark_stored_many(slots, hashes, gens)

    def _ship_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            self._ship()
            self._stop.wait(SHIP_INTERVAL_S)

    def _ship(self) -> None:
        with self._lock:
            items: list[_Item] = []
            n = 0
            while self._queue and n < SHIP_BATCH_MAX:
                item = self._queue.popleft()
                items.append(item)
                n += len(item[2])
            drops, self._unreported_drops = self._unreported_drops, 0
            if not items and not drops:
                return
            by_ns: dict[str, apb.NotifyRequest] = {}
            for item in items:
                key, store, hashes, slots, gens = item
                req = by_ns.get(key)
                if req is None:
                    attached = self.pools[key]
                    req = by_ns[key] = apb.NotifyRequest(
                        namespace=attached.info.namespace, epoch=attached.epoch
                    )
                if store:
                    keep = self._mark_stored(self.pools[key].pool, item)
                    whole = len(keep) == len(hashes)
                    req.stored_hashes.extend(hashes if whole else [hashes[i] for i in keep])
                    req.stored_slots.extend(slots if whole else [slots[i] for i in keep])
                    req.stored_generations.extend(gens if whole else [gens[i] for i in keep])
                else:
                    req.removed_hashes.extend(hashes)
                    req.removed_slots.extend(slots)
                    req.removed_generations.extend(gens)
            if drops and by_ns:
                next(iter(by_ns.values())).dropped = drops
            for req in by_ns.values():
                try:
                    self._stub.Notify(req, timeout=self.timeout_s)
                except grpc.RpcError:
                    # The agent is away (its resync from the headers will catch up),
                    # or serves another epoch (these slots are gone with the old file).
                    self.dropped += len(req.stored_hashes) + len(req.removed_hashes)
        if self._queue:
            self._wake.set()

    def flush(self) -> None:
        """Ship every queued notification now and return once the agent has them
        (before freeing slots, and in tests)."""
        while True:
            self._ship()
            with self._lock:  # also waits out a batch the shipper thread is sending
                if not self._queue:
                    return

    # ------------------------------------------------------------ reads

    def lookup(
        self, ns: pb.Namespace, chain: Sequence[bytes], timeout_s: float | None = None
    ) -> apb.EngineLookupResponse:
        pool = self._pool(ns)
        req = apb.EngineLookupRequest(namespace=ns, block_hashes=chain, epoch=pool.epoch)
        resp: object = None
        if self._lookups is not None:
            resp = self._lookups.ask(req, timeout_s or self.timeout_s)
        if resp is None:
            resp = self._call("Lookup", req, timeout_s)
        assert isinstance(resp, apb.EngineLookupResponse)
        self._check_epoch("Lookup", pool, resp.epoch)
        return resp

    def fetch(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        slots: Sequence[int],
        timeout_ms: int = 0,
        skip_blocks: int = 0,
        ticket: bytes = b"",
    ) -> apb.FetchResponse:
        """Pull chain[skip_blocks:] from a peer into `slots`; `valid_blocks` leading
        blocks (counted from skip_blocks) are valid. `ticket`: the load ticket of
        this chain's `lookup` (the agent then reads without a directory lookup)."""
        pool = self._pool(ns)
        req = apb.FetchRequest(
            namespace=ns,
            block_hashes=chain,
            slots=slots,
            timeout_ms=timeout_ms,
            skip_blocks=skip_blocks,
            epoch=pool.epoch,
            pid=self.pid,
            ticket=ticket,
        )
        # The agent's own deadline comes first; ours only covers the local hop.
        timeout_s = (timeout_ms / 1000 + 1.0) if timeout_ms else None
        resp: object = None
        if self._lookups is not None:
            resp = self._lookups.fetch(req, timeout_s or self.timeout_s)
        if resp is None:
            resp = self._call("Fetch", req, timeout_s)
        assert isinstance(resp, apb.FetchResponse)
        self._check_epoch("Fetch", pool, resp.epoch)
        return resp

    def _unmap(self) -> None:
        for p in self.pools.values():
            p.pool.close(unlink=False)

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._wake.set()
        self._shipper.join(2.0)
        self._unmap()
        if self._lookups is not None:
            self._lookups.close()
        self._channel.close()
