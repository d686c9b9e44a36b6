"""The connector's seam with the node agent: the few verbs it needs, and nothing else.

    lookup(chain)                -> Found      this node's pool prefix + the best peer prefix
                                               (+ the agent's load ticket for the peer part)
    reserve(n)                   -> slots      pool slots to write into (evicting LRU blocks)
    fetch(chain, skip, slots, ticket) -> Fetched  a peer's blocks chain[skip:] into those
                                               slots, read on the lookup's ticket (no second
                                               directory lookup; a refused ticket is a miss)
    stored(hashes, slots)                      the slots hold these blocks: keep and publish
    release(slots)                             give unused slots back

Errors: every verb raises AgentUnavailable (and nothing else) when the agent
cannot be reached or answers an error; after one, `available()` is False
for `agent_retry_s` so callers answer "nothing to load" without asking.
The pool mapping is the engine library's (agent/engine/client.py): bytes
never cross the socket. `stored` only queues (engine_client ships batches).

Pool epochs (agent/pool.py). When the agent answers for another epoch of the
pool, or the mapped file is marked retired (the agent restarted with a new
pool file), the verb raises AgentUnavailable and then:
- a seam that only looked up (the scheduler side) drops its client and
  attaches again on the next call;
- a seam bound to its mapping (handed out through `pool` / `attached_pool` to
  a copier, or holding slots from `reserve`) keeps that mapping and becomes
  `stale`, for good: every verb is refused from then on (the agent would
  refuse that epoch's slots anyway), loads in flight fail and vLLM
  recomputes. Its owner builds a new seam (and copier) to go on. Bytes and
  headers are thus always read through one mapping of one epoch, and no slot
  of an old epoch ever reaches the new file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdir.agent.engine.client import (
    EngineClient,
    EngineError,
    PoolChanged,
    Refused,
    _AttachedPool,
)
from kvdir.agent.engine.vllm.config import ConnectorConfig
from kvdir.agent.engine.vllm.namespace import NamespaceError, describe
from kvdir.agent.engine.vllm.plan import Found
from kvdir.agent.pool import KvPool
from kvdir.core.wire import namespace_key
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.vllm")

ATTACH_TIMEOUT_S = 2.0


class AgentUnavailable(Exception):
    """The node agent did not answer, or refused (the message says which)."""


@dataclass(frozen=True, slots=True)
class Fetched:
    valid_blocks: int
    transport: str = ""
    bytes: int = 0
    invalidated: int = 0
    source_node: str = ""
    seconds: float = 0.0
    """The agent's own time for the fetch (lookup, read, validation)."""
    read_seconds: float = 0.0
    """Of `seconds`: the data read, the header read and validation."""
    slots_retired: bool = False
    """A device copy into the slots may still land (it outlived the agent's deadline):
    never use them again (FetchResponse.slots_retired)."""


class AgentSeam:
    def __init__(
        self,
        cfg: ConnectorConfig,
        ns: pb.Namespace,
        slot_bytes_min: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        self.slot_bytes_min = slot_bytes_min
        self.clock = clock
        self._client: EngineClient | None = None
        self._bound = False
        """The mapping was handed out or slots were reserved: this seam stays on its epoch."""
        self.stale = False
        """Bound to an epoch the agent no longer serves: every verb is refused, for good."""
        self._down_until = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ attach

    def attach(self) -> EngineClient:
        """The engine client, attaching (again) when needed.

        A reachable agent without a pool for this namespace, or with slots too
        small, is a configuration error: NamespaceError says what to add.
        """
        with self._lock:
            if self.stale:
                raise AgentUnavailable(
                    "the agent replaced the pool file: this mapping's epoch is gone"
                )
            if self._client is not None:
                return self._client
            if self.clock() < self._down_until:
                raise AgentUnavailable("the agent failed recently")
            try:
                client = EngineClient(self.cfg.agent_socket, timeout_s=ATTACH_TIMEOUT_S)
            except EngineError as e:
                self._down_until = self.clock() + self.cfg.agent_retry_s
                raise AgentUnavailable(str(e)) from e
            key = namespace_key(self.ns)
            pool = client.pools.get(key)
            if pool is None or pool.info.slot_bytes < self.slot_bytes_min:
                client.close()
                have = "no pool" if pool is None else f"slots of {pool.info.slot_bytes} B"
                raise NamespaceError(
                    f"kvdir connector: the agent at {self.cfg.agent_socket} has {have} for this "
                    f"engine; add to its config: {describe(self.ns, self.slot_bytes_min)}"
                )
            self._client = client
            log.info(
                "attached to the kvdir agent",
                extra={"node": client.node_id, "epoch": f"{pool.epoch:#x}"},
            )
            return client

    def available(self) -> bool:
        """False for agent_retry_s after a failure, and for good once stale (callers
        then skip the agent)."""
        return not self.stale and self.clock() >= self._down_until

    @property
    def epoch(self) -> int:
        """The pool epoch this seam's client maps (0 when not attached)."""
        client = self._client
        return client.pools[namespace_key(self.ns)].epoch if client is not None else 0

    def attached_pool(self) -> _AttachedPool:
        """The pool of this namespace as the engine library maps it (info + mapping).

        Handing it out binds the seam to this mapping (see the module docstring).
        """
        client = self._client if self.stale else self.attach()
        if client is None:
            raise AgentUnavailable("this seam's pool mapping was closed")
        self._bound = True
        return client.pools[namespace_key(self.ns)]

    @property
    def pool(self) -> KvPool:
        return self.attached_pool().pool

    def pool_is_current(self) -> bool:
        """False when the agent now serves another pool file than the one we map
        (it restarted with a new shape or a new GPU tier): bytes it writes are not
        in our mapping, and our slot numbers mean nothing to it."""
        client = self._client
        return client is not None and not self.stale and client.current(self.ns)

    def _failed(self, e: Exception) -> AgentUnavailable:
        """Note a failure and re-check the mapping: callers back off; a mapping of an
        epoch the agent no longer serves is dropped (unbound) or marks the seam stale."""
        changed = isinstance(e, PoolChanged) or (
            self._client is not None and not self._client.current(self.ns)
        )
        if not changed:
            self._down_until = self.clock() + self.cfg.agent_retry_s
        elif self._bound:
            if not self.stale:
                log.warning(
                    "kvdir: the agent replaced the pool file; loads and saves stop "
                    "until the worker side attaches again: %s",
                    e,
                )
            self.stale = True
        else:
            self.close()  # attach again at the next call, no back-off
        return AgentUnavailable(str(e))

    # ------------------------------------------------------------- verbs

    def lookup(self, chain: Sequence[bytes]) -> Found:
        client = self.attach()
        try:
            resp = client.lookup(self.ns, chain, timeout_s=self.cfg.lookup_timeout_ms / 1000)
        except EngineError as e:
            raise self._failed(e) from e
        peer = max((p.prefix_blocks for p in resp.peers), default=0)
        return Found(
            tuple(resp.local_slots), peer, answered=True, ticket=resp.ticket, path=resp.fetch_path
        )

    def reserve(self, count: int) -> list[int]:
        client = self.attach()
        self._bound = True  # these slots are of this epoch
        try:
            return client.allocate(self.ns, count, evict=True).slots
        except EngineError as e:
            raise self._failed(e) from e

    def fetch(
        self, chain: Sequence[bytes], skip: int, slots: Sequence[int], ticket: bytes = b""
    ) -> Fetched:
        client = self.attach()
        try:
            r = client.fetch(
                self.ns, chain, slots, self.cfg.load_timeout_ms, skip_blocks=skip, ticket=ticket
            )
        except Refused as e:
            if not ticket:
                raise self._failed(e) from e
            # The agent is fine; this ticket is not (issued before it restarted, or
            # damaged on the way): these blocks are recomputed, nothing backs off.
            log.warning("kvdir: the agent refused a load ticket; recomputing: %s", e)
            return Fetched(0)
        except EngineError as e:
            raise self._failed(e) from e
        if not self.pool_is_current():  # replaced after it answered: not our file's bytes
            raise self._failed(PoolChanged("the agent's pool file changed under us"))
        return Fetched(
            r.valid_blocks, r.transport, r.bytes, r.invalidated, r.source_node,
            r.seconds, r.read_seconds, r.slots_retired,
        )  # fmt: skip

    def stored(self, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        client = self.attach()
        try:
            client.stored(self.ns, hashes, slots)
        except EngineError as e:
            raise self._failed(e) from e

    def release(self, slots: Sequence[int]) -> None:
        if not slots or self._client is None or self.stale:
            return  # a stale epoch's slots are gone with its file
        try:
            self._client.free(self.ns, slots)
        except EngineError as e:
            raise self._failed(e) from e

    def close(self) -> None:
        """Drop the client and its mapping. An unbound seam attaches again at its next
        verb; a bound one is done (`stale`): its slots and mapping were of one epoch."""
        with self._lock:
            client, self._client = self._client, None
            if self._bound:
                self.stale = True
        if client is not None:
            client.close()
