"""The agent's gRPC services: kvdir.v1.Engine (local engine) and kvdir.v1.Agent (peers).

Bad input gets INVALID_ARGUMENT (unknown namespace, slot out of range, a
chain and slot list of different lengths), an exhausted pool
RESOURCE_EXHAUSTED, slots of another pool epoch FAILED_PRECONDITION (the
caller maps a pool file this agent replaced: agent/pool.py); nothing a
caller sends can take the agent down.

Every slot the agent hands out is recorded as its caller's (agent/owners.py);
`AgentCore.reclaim_dead` frees the slots of engines that are gone.

One lookup per load: the engine's Lookup answers with a load ticket (the best
holders and their records, agent/tickets.py) and its Fetch brings it back, so
the fetch reads without asking the directory again. A malformed or foreign
ticket is INVALID_ARGUMENT; a stale one costs a miss (validation).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, cast

import grpc
import numpy as np

from kvdir.agent.directory_reads import read_holders
from kvdir.agent.fetcher import LOOKUP_NODES_MAX, Fetcher, FetchError
from kvdir.agent.gpu_pool import GpuTier
from kvdir.agent.holders import Holder
from kvdir.agent.limits import CHAIN_BLOCKS_MAX, TICKET_HOLDERS_MAX
from kvdir.agent.metrics import AgentMetrics
from kvdir.agent.owners import NO_OWNER, Owner, alive, owner_of
from kvdir.agent.pool import STALE_EPOCH, STORED, KvPool, PoolError, SlotHeader, valid_blocks
from kvdir.agent.publisher import Publisher
from kvdir.agent.tickets import BadTicket, StaleTicket, Tickets
from kvdir.core.security import current_identity
from kvdir.core.wire import AGENT_WIRE_VERSION, HASH_BYTES_MAX, BadNamespace, namespace_key
from kvdir.transfer.base import Region
from kvdir.transfer.engine import TransferEngine
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent")

NOTIFY_ENTRIES_MAX = 65536


@dataclass
class PoolState:
    """One pool and what the agent knows about it."""

    namespace: pb.Namespace
    pool: KvPool
    region: Region
    tier: int
    index: dict[bytes, int] = field(default_factory=dict)
    """block hash -> slot holding it (verified against the header on use)."""
    recency: OrderedDict[int, None] = field(default_factory=OrderedDict)
    """Slots the engine announced stored, least recently used first (eviction order)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    gpu: GpuTier | None = None
    """The agent-owned device slots of a TIER_GPU pool (agent/gpu_pool.py)."""
    gpu_rkey: int = 0
    fetching: Counter[int] = field(default_factory=Counter)
    """Slots a Fetch is writing into now: never reclaimed under it (its caller may
    have died, the bytes still land)."""

    def block_address(self, slot: int) -> int:
        """What the directory publishes for the block in `slot` (GPU address for a
        GPU pool, the host slot otherwise); one place, so removes match stores."""
        if self.gpu is not None:
            return self.gpu.slot_address(slot)
        return self.pool.slot_address(slot)

    @property
    def block_rkey(self) -> int:
        return self.gpu_rkey if self.gpu is not None else self.region.rkey

    def touch(self, slots: Sequence[int]) -> None:
        with self.lock:
            for s in slots:
                if s in self.recency:
                    self.recency.move_to_end(s)

    def forget(self, slots: Sequence[int]) -> None:
        with self.lock:
            for s in slots:
                self.recency.pop(s, None)

    def evict_lru(self, count: int, owner: Owner = NO_OWNER) -> list[tuple[int, SlotHeader]]:
        """Take up to `count` least recently used stored slots back for rewriting.

        Each slot's generation is bumped *before* it is handed out, so a reader
        of the old block fails validation once the new owner writes.
        """
        out: list[tuple[int, SlotHeader]] = []
        with self.lock:
            while len(out) < count and self.recency:
                slot, _ = self.recency.popitem(last=False)
                before = self.pool.header(slot)
                if before.state != STORED:
                    continue
                self.pool.evict(slot, owner)
                if self.index.get(before.block_hash) == slot:
                    del self.index[before.block_hash]
                out.append((slot, before))
        return out

    def info(self) -> apb.PoolInfo:
        g = self.pool.geometry
        return apb.PoolInfo(
            namespace=self.namespace,
            header_address=self.pool.header_address,
            header_bytes=64,
            data_address=self.pool.data_address,
            slot_bytes=g.slot_bytes,
            slots=g.slots,
            rkey=self.region.rkey,
            path=self.pool.mem.path,
            tier=cast("pb.Tier.ValueType", self.tier),
            gpu_address=self.gpu.address if self.gpu else 0,
            gpu_rkey=self.gpu_rkey if self.gpu else 0,
            gpu_device=self.gpu.device if self.gpu else 0,
            epoch=self.pool.epoch,
        )

    def reclaim_dead(self, is_alive: Callable[[Owner], bool] = alive) -> int:
        """Free the reserved slots of owners that are gone; how many came back."""
        n = 0
        for owner, slots in self.pool.allocated_by_owner(lambda o: not is_alive(o)).items():
            with self.lock:  # no Fetch starts into these slots while they are freed
                idle = [s for s in slots if not self.fetching[s]]
                got = self.pool.reclaim(idle, owner)
            self.forget(got)
            if got:
                log.info(
                    "reclaimed %d slots of engine pid %d (gone)",
                    len(got),
                    owner.pid,
                    extra={"epoch": self.pool.epoch},
                )
            n += len(got)
        return n

    def local_prefix(self, chain: Sequence[bytes]) -> list[int]:
        """Slots of the leading blocks of `chain` this pool holds (the index says
        where; the slot headers, checked in one vectorized pass, say whether)."""
        out = []
        where = self.index.get
        for h in chain:
            slot = where(h)
            if slot is None:
                break
            out.append(slot)
        if not out:
            return out
        ok = valid_blocks(self.pool.headers_of(out), chain[: len(out)], None)
        bad = np.flatnonzero(~ok)
        return out[: int(bad[0])] if len(bad) else out


def ns_key(ns: pb.Namespace) -> str:
    """The pool map's key: the one namespace key (a malformed namespace matches no pool)."""
    try:
        return namespace_key(ns)
    except BadNamespace:
        return ""


class AgentCore:
    """What both services share."""

    def __init__(
        self,
        node_id: str,
        pools: dict[str, PoolState],
        engine: TransferEngine,
        publisher: Publisher,
        fetcher: Fetcher,
        metrics: AgentMetrics,
    ) -> None:
        self.node_id = node_id
        self.pools = pools
        self.engine = engine
        self.publisher = publisher
        self.fetcher = fetcher
        self.metrics = metrics
        self.tickets = Tickets()
        """Signs the load tickets this process issues (a restart invalidates them)."""

    def pool_of(self, ns: pb.Namespace, context: grpc.ServicerContext, epoch: int = 0) -> PoolState:
        """The namespace's pool; a caller naming another epoch (0: none) is refused."""
        try:
            return self.pool(ns, epoch)
        except Refusal as e:
            _abort(context, e.code, str(e))

    def pool(self, ns: pb.Namespace, epoch: int = 0) -> PoolState:
        """`pool_of` for callers without a gRPC context: raises Refusal."""
        state = self.pools.get(ns_key(ns))
        if state is None:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this agent has no pool for namespace model={ns.model!r} "
                f"block_tokens={ns.block_tokens}",
            )
        if epoch and epoch != state.pool.epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{STALE_EPOCH}: the caller maps epoch {epoch:#x}, "
                f"the pool is {state.pool.epoch:#x}",
            )
        return state

    def reclaim_dead(self) -> int:
        """Slots of dead engines back to the free lists (the daemon calls this periodically)."""
        return sum(st.reclaim_dead() for st in self.pools.values())


class Refusal(Exception):
    """A request refused with a gRPC status code and a message (`code`, str(self)),
    raised where no gRPC context is at hand (the engine's lookup socket)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises


class AgentService(apb_grpc.AgentServicer):
    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def Handshake(
        self, request: apb.HandshakeRequest, context: grpc.ServicerContext
    ) -> apb.HandshakeResponse:
        if request.version != AGENT_WIRE_VERSION:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"wire version {request.version} is not supported (this is {AGENT_WIRE_VERSION})",
            )
        caller = current_identity()  # None only in plain mode; else authenticated
        if caller is not None and request.node_id != caller:
            _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"caller {caller!r} may not handshake as {request.node_id!r}",
            )
        resp = apb.HandshakeResponse(
            version=AGENT_WIRE_VERSION,
            node_id=self.core.node_id,
            incarnation=self.core.publisher.incarnation,
        )
        for d in self.core.engine.descriptors():
            resp.transports.add(name=d.name, params=d.params)
        resp.pools.extend(p.info() for p in self.core.pools.values())
        return resp

    def ConnectRdma(
        self, request: apb.ConnectRdmaRequest, context: grpc.ServicerContext
    ) -> apb.ConnectRdmaResponse:
        from kvdir.agent import rdma_link

        return rdma_link.serve_connect(self.core.node_id, self.core.engine, request, context)

    def Health(
        self, request: apb.AgentHealthRequest, context: grpc.ServicerContext
    ) -> apb.AgentHealthResponse:
        p = self.core.publisher
        return apb.AgentHealthResponse(
            node_id=self.core.node_id,
            incarnation=p.incarnation,
            directory_connected=p.connected,
            publish_queue_depth=p.queue_depth,
        )


class EngineService(apb_grpc.EngineServicer):
    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def Attach(
        self, request: apb.AttachRequest, context: grpc.ServicerContext
    ) -> apb.AttachResponse:
        return apb.AttachResponse(
            node_id=self.core.node_id,
            incarnation=self.core.publisher.incarnation,
            pools=[p.info() for p in self.core.pools.values()],
            transports=[
                apb.TransportDescriptor(name=d.name, params=d.params)
                for d in self.core.engine.descriptors()
                if d.name == "cuda"
            ],
        )

    def Allocate(
        self, request: apb.AllocateRequest, context: grpc.ServicerContext
    ) -> apb.AllocateResponse:
        state = self.core.pool_of(request.namespace, context, request.epoch)
        if request.count == 0:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "count must be > 0")
        owner = owner_of(request.pid)
        if request.evict:
            got = self._allocate_evicting(state, request.count, owner)
        else:
            try:
                got = state.pool.allocate(request.count, owner)
            except PoolError as e:
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.core.metrics.pool_free_slots.labels(ns_key(request.namespace)[:16]).set(
            state.pool.free_slots
        )
        return apb.AllocateResponse(
            slots=[s for s, _ in got], generations=[g for _, g in got], epoch=state.pool.epoch
        )

    def _allocate_evicting(
        self, state: PoolState, count: int, owner: Owner
    ) -> list[tuple[int, int]]:
        """Free slots first, then least recently used blocks; may return fewer."""
        got = state.pool.allocate(min(count, state.pool.free_slots), owner)
        if len(got) < count:
            evicted = state.evict_lru(count - len(got), owner)
            if evicted:
                self._publish_removed(state, evicted)
                got += [(s, state.pool.header(s).generation) for s, _ in evicted]
                self.core.metrics.pool_evictions.inc(len(evicted))
        return got

    def _publish_removed(self, state: PoolState, gone: list[tuple[int, SlotHeader]]) -> None:
        self.core.publisher.removed(
            state.namespace,
            state.tier,
            [h.block_hash for _, h in gone],
            [h.generation for _, h in gone],
            [state.block_address(s) for s, _ in gone],
        )

    def Free(self, request: apb.FreeRequest, context: grpc.ServicerContext) -> apb.FreeResponse:
        state = self.core.pool_of(request.namespace, context, request.epoch)
        try:
            freed = state.pool.free(list(request.slots))
        except PoolError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        state.forget([s for s, _ in freed])
        gone = [(s, h) for s, h in freed if h.state == STORED]
        if gone:
            with state.lock:
                for s, h in gone:
                    if state.index.get(h.block_hash) == s:
                        del state.index[h.block_hash]
            self._publish_removed(state, gone)
        return apb.FreeResponse(freed=len(freed))

    def Notify(
        self, request: apb.NotifyRequest, context: grpc.ServicerContext
    ) -> apb.NotifyResponse:
        state = self.core.pool_of(request.namespace, context, request.epoch)
        n = len(request.stored_hashes)
        if n > NOTIFY_ENTRIES_MAX or len(request.removed_hashes) > NOTIFY_ENTRIES_MAX:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"over {NOTIFY_ENTRIES_MAX} notifications in one batch",
            )
        if (
            not (len(request.stored_slots) == len(request.stored_generations) == n)
            or len(request.removed_slots) != len(request.removed_hashes)
            or len(request.removed_generations) != len(request.removed_hashes)
        ):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "notification columns differ")
        if request.dropped:
            self.core.metrics.engine_dropped.inc(request.dropped)
        # Removals first: stores are checked against the slot headers (the truth),
        # so one batch with "evicted g1" and "stored again under g2" must end stored.
        if request.removed_hashes:
            with state.lock:
                for h, s in zip(request.removed_hashes, request.removed_slots, strict=True):
                    if state.index.get(h) == s:
                        del state.index[h]
                        state.recency.pop(s, None)
            pool = state.pool
            slots = list(request.removed_slots)
            if any(not 0 <= s < pool.geometry.slots for s in slots):
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a removed slot is out of range")
            self.core.publisher.removed(
                state.namespace,
                state.tier,
                list(request.removed_hashes),
                list(request.removed_generations),
                [state.block_address(s) for s in slots],
            )
        self._stored(state, request)
        return apb.NotifyResponse()

    def _stored(self, state: PoolState, request: apb.NotifyRequest) -> None:
        pool = state.pool
        hashes, slots = list(request.stored_hashes), list(request.stored_slots)
        gens = list(request.stored_generations)
        n_slots = pool.geometry.slots
        usable = [
            i
            for i, (h, s) in enumerate(zip(hashes, slots, strict=True))
            if 0 <= s < n_slots and 0 < len(h) <= HASH_BYTES_MAX
        ]
        if len(usable) < len(hashes):
            hashes, slots = [hashes[i] for i in usable], [slots[i] for i in usable]
            gens = [gens[i] for i in usable]
        # The header is the truth; a notification that no longer matches it (the
        # slot was evicted since) is not published. One vectorized check: a step's
        # or a fetch's hundreds of blocks arrive in one notification.
        keep = np.flatnonzero(valid_blocks(pool.headers_of(slots), hashes, gens)).tolist()
        stale = len(request.stored_hashes) - len(keep)
        if len(keep) < len(hashes):
            hashes, slots = [hashes[i] for i in keep], [slots[i] for i in keep]
            gens = [gens[i] for i in keep]
        if stale:
            self.core.metrics.stale_notifications.inc(stale)
        if not hashes:
            return
        with state.lock:
            index, recency = state.index, state.recency
            for h, s in zip(hashes, slots, strict=True):
                index[h] = s
                recency[s] = None
                recency.move_to_end(s)
        n = len(hashes)
        self.core.publisher.stored(
            state.namespace,
            state.tier,
            hashes,
            [state.block_address(s) for s in slots],
            [pool.geometry.slot_bytes] * n,
            [state.block_rkey] * n,
            gens,
        )

    def Lookup(
        self, request: apb.EngineLookupRequest, context: grpc.ServicerContext
    ) -> apb.EngineLookupResponse:
        try:
            resp, directory_error = self.answer_lookup(request)
        except Refusal as e:
            _abort(context, e.code, str(e))
        if directory_error:
            context.set_trailing_metadata((("kvdir-directory-error", directory_error),))
        return resp

    def answer_lookup(
        self, request: apb.EngineLookupRequest
    ) -> tuple[apb.EngineLookupResponse, str]:
        """The Lookup's answer, and why the directory could not be asked ("" when it
        was): the gRPC method and the lookup socket (agent/lookup_socket.py) both
        answer here. Raises Refusal."""
        state = self.core.pool(request.namespace, request.epoch)
        chain = list(request.block_hashes)
        if len(chain) > CHAIN_BLOCKS_MAX:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"chain over {CHAIN_BLOCKS_MAX} blocks")
        self.core.metrics.lookups.inc()
        local = state.local_prefix(chain)
        state.touch(local)
        resp = apb.EngineLookupResponse(
            local_blocks=len(local), local_slots=local, epoch=state.pool.epoch
        )
        if not chain:
            return resp, ""
        # The fetcher's directory reads: the agent's mirror while it is fresh, so
        # the connector's scheduler side costs one local call and no directory load.
        try:
            found = read_holders(
                self.core.fetcher.directory,
                request.namespace,
                chain,
                LOOKUP_NODES_MAX,
                exclude_node=self.core.node_id,
            )
        except Exception as e:  # the directory being down must not fail local answers
            return resp, str(e)[:200]
        for m in found:
            resp.peers.add(
                node_id=m.node_id, prefix_blocks=m.prefix_blocks, transports=m.transports
            )
        resp.ticket, resp.fetch_path = self._ticket(state, request.namespace, found, len(local))
        return resp, ""

    def _ticket(
        self, state: PoolState, ns: pb.Namespace, matches: Sequence[Holder], local: int
    ) -> tuple[bytes, str]:
        """The load ticket of the holders a fetch would try and the best one's path,
        when one holds more than this node's pool ((b"", "") otherwise: nothing to fetch)."""
        cands = self.core.fetcher.candidates(matches, state.gpu is not None)
        if not cands or cands[0].blocks <= local:  # blocks: what its path can read
            return b"", ""
        best = [c.match for c in cands[:TICKET_HOLDERS_MAX]]
        ticket = self.core.tickets.issue(ns_key(ns), state.pool.epoch, best)
        return ticket, self.core.fetcher.read_over(cands[0])

    def Fetch(self, request: apb.FetchRequest, context: grpc.ServicerContext) -> apb.FetchResponse:
        try:
            return self.answer_fetch(request)
        except Refusal as e:
            _abort(context, e.code, str(e))

    def answer_fetch(self, request: apb.FetchRequest) -> apb.FetchResponse:
        """The Fetch's answer: the gRPC method and the lookup socket's fetch frames
        (agent/lookup_socket.py) both answer here. Raises Refusal."""
        state = self.core.pool(request.namespace, request.epoch)
        chain, slots = list(request.block_hashes), list(request.slots)
        if len(chain) > CHAIN_BLOCKS_MAX:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"chain over {CHAIN_BLOCKS_MAX} blocks")
        ticket_holders = None
        if request.ticket:
            try:
                ticket_holders = self.core.tickets.check(
                    request.ticket, ns_key(request.namespace), state.pool.epoch
                )
            except BadTicket as e:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            except StaleTicket:
                self.core.metrics.fetches.labels("miss").inc()
                return apb.FetchResponse(epoch=state.pool.epoch)
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        owner = owner_of(request.pid) if request.pid else None
        with state.lock:  # the reaper decides under this lock too: one or the other wins
            if owner is not None and not state.pool.held_by(slots, owner):
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "fetch into slots this engine does not hold (reserve them with Allocate)",
                )
            state.fetching.update(slots)
        try:
            r = self.core.fetcher.fetch(
                request.namespace,
                state.pool,
                chain,
                slots,
                timeout,
                gpu=state.gpu,
                skip=request.skip_blocks,
                ticket_holders=ticket_holders,
            )
        except (FetchError, PoolError) as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        finally:
            with state.lock:
                # One pass in C-level dict calls: Counter.subtract and Counter's own
                # __delitem__ took ~0.5 ms for a 512-block fetch.
                fetching = state.fetching
                for s in slots:
                    left = fetching.get(s, 0) - 1
                    if left > 0:
                        fetching[s] = left
                    else:
                        fetching.pop(s, None)
        m = self.core.metrics
        m.fetch_seconds.observe(r.seconds)
        m.fetches.labels("hit" if r.valid_blocks else "miss").inc()
        m.fetch_blocks.inc(r.valid_blocks)
        if r.invalidated:
            m.validation_failures.inc(r.invalidated)
        if r.transport:
            m.fetch_bytes.labels(r.transport).inc(r.bytes)
            m.transfer_seconds.labels(r.transport).inc(r.seconds)
        return apb.FetchResponse(
            valid_blocks=r.valid_blocks,
            source_node=r.source_node,
            transport=r.transport,
            bytes=r.bytes,
            invalidated=r.invalidated,
            seconds=r.seconds,
            read_seconds=r.read_seconds,
            path=r.path,
            epoch=state.pool.epoch,
            slots_retired=r.slots_retired,
        )
