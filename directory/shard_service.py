"""A sharded replica's link to the shard map: learning it, following it, and
refusing the requests its group does not own (docs/sharding.md).

- `HomeClient` asks the home group's replicas for the map (GetShardMap), each
  in turn, within one deadline.
- `MapRefresher` (a thread) keeps the replica's `ShardView` current: every
  `interval_s`, and at once when woken (a request carried a newer version).
  On the home group it reads the map from its own table, and its leader
  commits the `--shard-map-init` map when none is committed yet.
- `ShardGuard` is the gRPC side: the check on Publish/Remove/Lookup/
  LookupBatch, and GetShardMap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import grpc

from kvdir.core import shard_wire
from kvdir.core.security import ClientSecurity
from kvdir.core.shard_map import ShardMap, ShardMapError
from kvdir.directory.commands import SetShardMap
from kvdir.directory.consensus.port import Consensus
from kvdir.directory.shard_view import NoShardMap, ShardView, WrongShard
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.directory.shards")

FETCH_CALL_TIMEOUT_S = 1.0
"""One GetShardMap call to one home replica."""
SYNC_REFRESH_MAX_S = 1.0
"""How long a request that names a newer map than this replica knows may wait
for it (at most its own deadline)."""
INIT_WRITE_TIMEOUT_S = 5.0
NO_MAP_INTERVAL_S = 0.1
"""The refresh period while the replica has no map yet (it refuses every keyed request)."""

Fetch = Callable[[int, float], ShardMap | None]
"""(min_version, timeout_s) -> the newest map found, or None."""


class HomeClient:
    """GetShardMap from the home group's replicas, one channel each, kept open."""

    def __init__(self, addresses: Sequence[str], security: ClientSecurity) -> None:
        self._addresses = list(addresses)
        self._security = security
        self._stubs: dict[str, pb_grpc.PrefixDirectoryStub] = {}
        self._channels: list[grpc.Channel] = []
        self._next = 0

    def _stub(self, address: str) -> pb_grpc.PrefixDirectoryStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._security.channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = pb_grpc.PrefixDirectoryStub(channel)
        return stub

    def fetch(self, min_version: int, timeout_s: float) -> ShardMap | None:
        """The first map a home replica gives within `timeout_s` (None: none did)."""
        deadline = time.monotonic() + timeout_s
        n = len(self._addresses)
        for k in range(n):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            address = self._addresses[(self._next + k) % n]
            try:
                resp = self._stub(address).GetShardMap(
                    pb.GetShardMapRequest(min_version=min_version),
                    timeout=min(FETCH_CALL_TIMEOUT_S, left),
                )
                if resp.HasField("map"):
                    return shard_wire.from_pb(resp.map)
            except (grpc.RpcError, ShardMapError) as e:
                log.debug("shard map fetch failed", extra={"home": address, "error": str(e)})
            self._next = (self._next + k + 1) % n  # start at the next one next time
        return None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


class MapRefresher:
    """Keeps `view` current, bounded: one fetch per `interval_s` unless woken.

    `clock` (seconds, monotonic) is injected so a test can drive `step` and
    `due_in` without waiting; `run` is the thread's loop and ends with `stop`.
    """

    def __init__(
        self,
        view: ShardView,
        fetch: Fetch,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        init: Callable[[], None] | None = None,
    ) -> None:
        self.view = view
        self.fetch = fetch
        self.interval_s = interval_s
        self.clock = clock
        self.init = init
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self._step_lock = threading.Lock()
        self.last_step_s: float | None = None
        self.failures = 0

    def step(self, timeout_s: float = FETCH_CALL_TIMEOUT_S * 3) -> bool:
        """One refresh now, within `timeout_s`; whether the view took a newer map."""
        if not self._step_lock.acquire(timeout=timeout_s):
            return False  # another step is under way; it will offer what it finds
        try:
            self.last_step_s = self.clock()
            try:
                m = self.fetch(self.view.version, timeout_s)
            except Exception:
                log.exception("shard map refresh failed")
                m = None
            if m is None:
                self.failures += 1
                return False
            self.failures = 0
            taken = self.view.offer(m)
            if taken:
                log.info("shard map updated", extra={"version": m.version})
            return taken
        finally:
            self._step_lock.release()

    def due_in(self) -> float:
        """Seconds until the next refresh is due (0: now)."""
        if self.last_step_s is None:
            return 0.0
        interval = (
            self.interval_s if self.view.shard_map else min(self.interval_s, NO_MAP_INTERVAL_S)
        )
        return max(0.0, self.last_step_s + interval - self.clock())

    def wake(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self._wake.wait(self.due_in())
            self._wake.clear()
            if self.stop_event.is_set():
                return
            if self.init is not None and self.view.shard_map is None:
                try:
                    self.init()
                except Exception:
                    log.exception("committing the initial shard map failed")
            self.step()

    def stop(self) -> None:
        self.stop_event.set()
        self._wake.set()


def own_table_fetch(consensus: Consensus) -> Fetch:
    """The home group's source: the map in this replica's own applied table."""

    def fetch(_min_version: int, _timeout_s: float) -> ShardMap | None:
        return consensus.read(lambda t: t.shard_map)

    return fetch


def init_committer(consensus: Consensus, init_map: ShardMap) -> Callable[[], None]:
    """On the home group's leader, commit `init_map` if no map is committed yet.

    Every home replica may be given the same file; the compare-and-set
    (expected version 0) lets exactly one proposal win, whichever leads.
    """

    def commit() -> None:
        if not consensus.is_leader() or consensus.read(lambda t: t.shard_map) is not None:
            return
        res = consensus.write(SetShardMap(0, init_map), INIT_WRITE_TIMEOUT_S)
        log.info(
            "initial shard map proposed",
            extra={"version": init_map.version, "outcome": res.outcome.value},
        )

    return commit


class ShardGuard:
    """The shard check and GetShardMap, as gRPC statuses."""

    def __init__(self, view: ShardView, refresher: MapRefresher | None) -> None:
        self.view = view
        self.refresher = refresher

    def check(self, hashes: Sequence[bytes], context: grpc.ServicerContext) -> None:
        view = self.view
        if view.owns_all:
            return
        wanted = shard_wire.version_of(context.invocation_metadata())
        try:
            view.check(hashes)
        except NoShardMap as e:
            # Only a caller that knows a map waits for one (bounded); the rest are told
            # at once, so a replica starting under load does not hold its workers.
            self._refresh_for(wanted, context)
            if view.shard_map is None:
                self._no_map(context, str(e))
        except WrongShard as e:
            if wanted <= view.version or not self._refresh_for(wanted, context):
                self._wrong(context, e)
        else:
            if wanted > view.version and self.refresher is not None:
                self.refresher.wake()
            return
        try:  # the map changed under the refresh: check once more
            view.check(hashes)
        except WrongShard as e:
            self._wrong(context, e)
        except NoShardMap as e:
            self._no_map(context, str(e))

    def _refresh_for(self, wanted: int, context: grpc.ServicerContext) -> bool:
        """Refresh now, bounded, when the caller knows a newer map; whether one came."""
        if self.refresher is None or wanted <= self.view.version:
            return False
        left = context.time_remaining()
        budget = SYNC_REFRESH_MAX_S if left is None else min(SYNC_REFRESH_MAX_S, left * 0.5)
        return self.refresher.step(max(0.0, budget))

    def _wrong(self, context: grpc.ServicerContext, e: WrongShard) -> NoReturn:
        context.set_trailing_metadata(
            (
                ("kvdir-reason", shard_wire.REASON_WRONG_SHARD),
                (shard_wire.SHARD_MAP_VERSION_KEY, str(e.version)),
            )
        )
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def moving(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        """A lookup of a shard this group's log has fenced (`ShardFence.lookup_refusal`)."""
        context.set_trailing_metadata(
            (
                ("kvdir-reason", shard_wire.REASON_SHARD_MOVING),
                (shard_wire.SHARD_MAP_VERSION_KEY, str(self.view.version)),
            )
        )
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)

    def _no_map(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        context.set_trailing_metadata(
            (
                ("kvdir-reason", shard_wire.REASON_NO_SHARD_MAP),
                ("kvdir-outcome", "not-applied"),
                (shard_wire.SHARD_MAP_VERSION_KEY, "0"),
            )
        )
        context.abort(grpc.StatusCode.UNAVAILABLE, message)

    def get_map(
        self, request: pb.GetShardMapRequest, context: grpc.ServicerContext
    ) -> pb.GetShardMapResponse:
        view = self.view
        resp = pb.GetShardMapResponse(group_id=view.group_id, home=view.home)
        if not view.sharded:
            return resp
        self._refresh_for(request.min_version, context)
        m = view.shard_map
        if m is None:
            self._no_map(context, "no shard map yet: this replica has not learned one")
        resp.map.CopyFrom(shard_wire.to_pb(m))
        return resp


__all__ = [
    "HomeClient",
    "MapRefresher",
    "ShardGuard",
    "init_committer",
    "own_table_fetch",
]
