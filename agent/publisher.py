"""Asynchronous publishing of the node's holdings to the directory.

`stored()` / `removed()` only record the change in a bounded pending map and
return; a background thread sends them at its own pace (TigerBeetle's "batch
at your own pace"): when `batch_entries_max` changes are pending or
`batch_window_s` after the first one, whichever comes first.

- Coalescing: the pending map is keyed by (namespace, tier, block hash), so a
  store and a later remove of the same block leave one change (the last).
- Retries: the directory client retries leader changes within its deadline;
  a batch that still fails goes back into the pending map (a newer change to
  the same block wins), and every directory write is idempotent, so a retry
  never duplicates an effect.
- Never blocking the engine: when the map is full the change is dropped and
  counted, and a resync is scheduled; a resync re-publishes everything the
  pool headers say is stored (the truth), which repairs any drop.
- Session: registers the node under a fresh incarnation, heartbeats its lease,
  and on `unknown-node` (the directory expired us or lost its state)
  registers again and re-publishes the full holdings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvdir.core.client import DirectoryError
from kvdir.core.sharded_client import AnyDirectoryClient
from kvdir.core.wire import namespace_key
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent.publisher")

Holding = tuple[bytes, int, int, int, int]
"""(block hash, address, length, rkey, generation) of one stored block."""


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    host: str
    endpoint: str
    transports: tuple[str, ...]
    lease_ms: int


@dataclass(frozen=True, slots=True)
class PublisherLimits:
    pending_max: int = 65_536
    batch_entries_max: int = 4_096
    batch_window_s: float = 0.005
    resync_interval_s: float = 300.0
    retry_backoff_s: float = 0.2


@dataclass(slots=True)
class _Change:
    store: bool
    address: int
    length: int
    rkey: int
    generation: int


_Key = tuple[str, int, bytes]  # (namespace key, tier, hash)


class Publisher:
    def __init__(
        self,
        client: AnyDirectoryClient,
        node: NodeIdentity,
        holdings: Callable[[], Iterable[tuple[pb.Namespace, int, list[Holding]]]],
        limits: PublisherLimits | None = None,
        incarnation: Callable[[], int] = time.time_ns,
    ) -> None:
        self.client = client
        self.node = node
        self.holdings = holdings
        self.limits = limits or PublisherLimits()
        self._new_incarnation = incarnation
        self.incarnation = 0
        self._namespaces: dict[str, pb.Namespace] = {}
        self._pending: dict[_Key, _Change] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.published = 0
        self.removed_count = 0
        self.failures = 0
        self.resyncs = 0
        self.connected = False
        self.last_publish_s = 0.0
        self._last_send = 0.0

    # ------------------------------------------------------------- enqueue

    @staticmethod
    def ns_key(ns: pb.Namespace) -> str:
        return namespace_key(ns)

    def _enqueue(
        self, ns: pb.Namespace, tier: int, hashes: Sequence[bytes], changes: Iterable[_Change]
    ) -> None:
        key = self.ns_key(ns)
        with self._lock:
            self._namespaces.setdefault(key, ns)
            pending = self._pending
            was_empty = not pending
            room = self.limits.pending_max - len(pending)
            for h, c in zip(hashes, changes, strict=True):
                k = (key, tier, h)
                if room <= 0 and k not in pending:
                    self.dropped += 1
                    self._resync.set()
                    continue
                if k not in pending:
                    room -= 1
                pending[k] = c
            if was_empty or len(pending) >= self.limits.batch_entries_max:
                self._wake.notify()

    def stored(
        self,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        addresses: Sequence[int],
        lengths: Sequence[int],
        rkeys: Sequence[int],
        generations: Sequence[int],
    ) -> None:
        """Announce blocks now held (never blocks; may drop under overload)."""
        self._enqueue(
            ns,
            tier,
            hashes,
            (
                _Change(True, a, n, r, g)
                for a, n, r, g in zip(addresses, lengths, rkeys, generations, strict=True)
            ),
        )

    def removed(
        self,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        generations: Sequence[int],
        addresses: Sequence[int],
    ) -> None:
        """Announce blocks no longer held in these slots (never blocks; may drop).

        The directory removes a record only if it is still this slot's, at this
        generation or older: a block already re-stored elsewhere stays.
        """
        self._enqueue(
            ns,
            tier,
            hashes,
            (_Change(False, a, 0, 0, g) for g, a in zip(generations, addresses, strict=True)),
        )

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    # ----------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.register(new_incarnation=True)
        self.resync()
        self._thread = threading.Thread(target=self._run, name="kvdir-publisher", daemon=True)
        self._thread.start()
        threading.Thread(target=self._heartbeat_loop, name="kvdir-lease", daemon=True).start()

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if deregister and self.incarnation:
            try:
                self.client.clear_node(self.node.node_id, self.incarnation, deregister=True)
            except DirectoryError as e:
                log.warning("could not deregister on stop", extra={"error": str(e)})

    def register(self, new_incarnation: bool) -> None:
        if new_incarnation or not self.incarnation:
            self.incarnation = max(self._new_incarnation(), self.incarnation + 1)
        n = self.node
        self.client.register_node(
            n.node_id, n.host, self.incarnation, n.endpoint, n.transports, n.lease_ms
        )
        self.connected = True
        log.info(
            "registered with the directory",
            extra={"node_id": n.node_id, "incarnation": self.incarnation},
        )

    def resync(self) -> int:
        """Publish every stored block (the pool headers are the truth)."""
        sent = 0
        for ns, tier, items in self.holdings():
            for i in range(0, len(items), self.limits.batch_entries_max):
                part = items[i : i + self.limits.batch_entries_max]
                self.client.publish(
                    self.node.node_id,
                    self.incarnation,
                    ns,
                    tier,
                    [p[0] for p in part],
                    [p[1] for p in part],
                    [p[2] for p in part],
                    [p[3] for p in part],
                    [p[4] for p in part],
                )
                sent += len(part)
        self.resyncs += 1
        log.info("full holdings published", extra={"entries": sent})
        return sent

    # ---------------------------------------------------------------- loop

    def _take(self) -> dict[_Key, _Change]:
        with self._lock:
            if not self._pending and not self._stop.is_set():
                self._wake.wait(timeout=1.0)
            busy = time.monotonic() - self._last_send < self.limits.batch_window_s
            if busy and self._pending and len(self._pending) < self.limits.batch_entries_max:
                # Sent a moment ago: let this burst gather for one window. After a
                # quiet spell the first change goes out at once (visibility latency).
                self._wake.wait(timeout=self.limits.batch_window_s)
            batch, self._pending = self._pending, {}
            if batch:
                self._last_send = time.monotonic()
            return batch

    def _requeue(self, batch: dict[_Key, _Change]) -> None:
        with self._lock:
            for k, c in batch.items():
                self._pending.setdefault(k, c)  # a newer change to the same block wins

    def _run(self) -> None:
        last_resync = time.monotonic()
        while not self._stop.is_set():
            batch = self._take()
            if batch:
                try:
                    self._send(batch)
                except DirectoryError as e:
                    self._on_failure(e, batch)
            due = time.monotonic() - last_resync > self.limits.resync_interval_s
            if self._resync.is_set() or due:
                self._resync.clear()
                last_resync = time.monotonic()
                try:
                    self.resync()
                except DirectoryError as e:
                    self._on_failure(e, {})
                    self._resync.set()

    def _on_failure(self, e: DirectoryError, batch: dict[_Key, _Change]) -> None:
        self.failures += 1
        self._requeue(batch)
        log.warning("publish failed; will retry", extra={"error": str(e), "reason": e.reason})
        if e.reason in ("unknown-node", "stale-incarnation"):
            self.connected = False
            try:
                self.register(new_incarnation=e.reason == "stale-incarnation")
                self._resync.set()
            except DirectoryError as e2:
                log.warning("re-register failed", extra={"error": str(e2)})
        self._stop.wait(self.limits.retry_backoff_s)

    def _send(self, batch: dict[_Key, _Change]) -> None:
        groups: dict[tuple[str, int, bool], list[tuple[bytes, _Change]]] = {}
        for (nsk, tier, h), c in batch.items():
            groups.setdefault((nsk, tier, c.store), []).append((h, c))
        t0 = time.perf_counter()
        for (nsk, tier, store), items in groups.items():
            ns = self._namespaces[nsk]
            for i in range(0, len(items), self.limits.batch_entries_max):
                part = items[i : i + self.limits.batch_entries_max]
                hashes = [h for h, _ in part]
                node, inc = self.node.node_id, self.incarnation
                try:
                    self._send_part(ns, tier, store, node, inc, part)
                except DirectoryError as e:
                    # A sharded directory: the groups that took their part keep it;
                    # only the rest is requeued (a dead group stalls only its blocks).
                    for j in e.committed:
                        batch.pop((nsk, tier, hashes[j]), None)
                    raise
                if store:
                    self.published += len(part)
                else:
                    self.removed_count += len(part)
                # Sent: drop these from the batch so a failure later requeues only the rest.
                for h in hashes:
                    batch.pop((nsk, tier, h), None)
        self.last_publish_s = time.perf_counter() - t0

    def _send_part(
        self,
        ns: pb.Namespace,
        tier: int,
        store: bool,
        node: str,
        inc: int,
        part: list[tuple[bytes, _Change]],
    ) -> None:
        hashes = [h for h, _ in part]
        if store:
            self.client.publish(
                node,
                inc,
                ns,
                tier,
                hashes,
                [c.address for _, c in part],
                [c.length for _, c in part],
                [c.rkey for _, c in part],
                [c.generation for _, c in part],
            )
        else:
            self.client.remove(
                node,
                inc,
                ns,
                tier,
                hashes,
                [c.generation for _, c in part],
                [c.address for _, c in part],
            )

    def _heartbeat_loop(self) -> None:
        interval = self.node.lease_ms / 3000
        while not self._stop.wait(interval):
            try:
                self.client.heartbeat(self.node.node_id, self.incarnation)
                self.connected = True
            except ValueError:
                # The client was closed under a heartbeat in flight: the agent is
                # stopping (stop() does not join this thread), so leave quietly.
                if self._stop.is_set():
                    return
                raise
            except DirectoryError as e:
                self.connected = False
                if e.reason in ("unknown-node", "stale-incarnation"):
                    try:
                        self.register(new_incarnation=e.reason == "stale-incarnation")
                        self._resync.set()
                        with self._lock:
                            self._wake.notify()
                    except DirectoryError as e2:
                        log.warning("re-register failed", extra={"error": str(e2)})
                else:
                    log.warning("heartbeat failed", extra={"error": str(e)})
