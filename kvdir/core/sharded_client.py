"""A client of a sharded directory: `DirectoryClient`'s surface over several groups.

It follows the shard map held by the home group (GetShardMap at start, and
again when a replica refuses a request as `wrong_shard` or names a newer map
version), keeps one `DirectoryClient` per group (leader hints, retries and
outcomes as there), and sends every request where the map says:

- Publish and Remove by hashes are split by group (`ShardMap.positions_by_group`)
  and the parts sent in parallel on a bounded pool under one deadline. A call
  is acknowledged only when every part committed; when any part's outcome is
  unknown the whole call's is (`OutcomeUnknown`); a part refused as
  `wrong_shard` is re-split under the refreshed map and sent again (bounded).
  Parts that committed stay committed: every write is idempotent, so the
  caller's retry of the whole call is safe.
- Node-wide commands (RegisterNode, Heartbeat, ClearNode, a Remove with no
  hashes) go to every group: each group's lease sweeper expires a node on its
  own, so a crashed node's records go from every shard.
- Lookups go to the groups that own a block of the chain, each with its own
  subsequence, and the answers are merged (`shard_merge`). A group that cannot
  answer counts as holding nothing: prefixes end at its first block; never an
  error. Such a group is skipped for `GROUP_DOWN_S` (one probe per interval),
  so a dead group costs lookups nothing but a miss. A group that refuses as
  `shard_moving` (its log has fenced a shard of the chain: moving away, maybe
  partly dropped, or still importing) counts as holding nothing for that call
  only; it is not skipped afterwards.

Errors are `kvdir.core.client`'s tree; of several failed parts the caller sees
the most telling: unknown outcome, then a refusal with a reason (an agent
re-registers on `unknown-node`), then unavailability.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

import grpc

from kvdir.core import shard_wire
from kvdir.core.client import (
    DirectoryClient,
    DirectoryError,
    DirectoryRequests,
    OutcomeUnknown,
    Unavailable,
    lookup_request,
)
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.shard_map import Group, ShardMap, ShardMapError, even_map
from kvdir.core.shard_merge import Positions, merge_lookup
from kvdir.core.shard_route import Router
from kvdir.directory.limits import RequestLimits
from kvdir.v1 import directory_pb2 as pb

T = TypeVar("T")
R = TypeVar("R", pb.PublishRequest, pb.RemoveRequest)

REROUTE_ATTEMPTS_MAX = 8
"""Times one call is re-split after `wrong_shard` refusals (each after a map refresh)."""
MAP_REFRESH_S_MIN = 0.05
"""Least time between two asks of the home group for a map it did not ask for by version."""
WORKERS_MAX = 32
"""Threads sending parts in parallel (one per group is enough for 32 groups)."""
LOOKUP_TIMEOUT_S_MAX = 1.0
"""A lookup waits at most this long for a group (then counts it as holding nothing)."""
GROUP_DOWN_S = 1.0
"""A group whose lookup failed is skipped this long (a miss), then probed again."""
UNSHARDED_GROUP = "g0"
"""The group id given to a home that answers without a map (an unsharded directory)."""
_DEFAULT_NODES = RequestLimits().lookup_nodes_default


def chain_hashes(req: pb.LookupRequest) -> list[bytes]:
    """A lookup's chain as a list of hashes, whichever wire form it came in
    (block ids as 8 bytes big-endian, as the replicas read them)."""
    if req.packed_hashes or req.hash_width:
        w, data = req.hash_width, req.packed_hashes
        if not w or len(data) % w:
            return []  # malformed: the replica that gets it says why
        return [data[i : i + w] for i in range(0, len(data), w)]
    if req.block_ids and not req.block_hashes:
        packed = struct.pack(f">{len(req.block_ids)}Q", *req.block_ids)
        return [packed[i : i + 8] for i in range(0, len(packed), 8)]
    return list(req.block_hashes)


# A write's per-block columns: what one group's part of it holds a slice of.
_PUBLISH_COLUMNS = ("block_hashes", "addresses", "lengths", "rkeys", "generations")
_REMOVE_COLUMNS = ("block_hashes", "generations", "addresses")


def _parts(req: R, columns: tuple[str, ...]) -> Callable[[list[int]], R]:
    """Cuts `req` to positions of its hashes: each column sliced, one of another
    length sent whole (the replica refuses it, as it would the whole request).
    Moves the columns out of `req` (the call's own request, built for it): what
    stays is what every part shares, merged in, not copied whole and cleared."""
    n = len(req.block_hashes)
    cols = [(name, list(getattr(req, name))) for name in columns]
    for name in columns:
        req.ClearField(name)  # type: ignore[arg-type]

    def part(idx: list[int]) -> R:
        sliced: dict[str, Any] = {
            name: [c[i] for i in idx] if len(c) == n else c for name, c in cols
        }
        out = type(req)(**sliced)
        out.MergeFrom(req)
        return out

    return part


def _registered(got: list[pb.RegisterNodeResponse]) -> pb.RegisterNodeResponse:
    """Registered in every group: the earliest lease expiry."""
    out = pb.RegisterNodeResponse()
    out.CopyFrom(min(got, key=lambda r: r.lease_expiry_ms))
    out.replaced_incarnation = any(r.replaced_incarnation for r in got)
    return out


def _heartbeat(got: list[pb.HeartbeatResponse]) -> pb.HeartbeatResponse:
    return pb.HeartbeatResponse(lease_expiry_ms=min(r.lease_expiry_ms for r in got))


def _cleared(got: list[pb.ClearNodeResponse]) -> pb.ClearNodeResponse:
    return pb.ClearNodeResponse(removed=sum(r.removed for r in got))


_MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "RegisterNode": _registered,
    "Heartbeat": _heartbeat,
    "ClearNode": _cleared,
}
"""How every group's answers to a node-wide command make one answer."""


def _with_committed(e: DirectoryError, committed: list[int]) -> DirectoryError:
    """A copy of `e` (same class, code, reason, metadata) naming the committed positions."""
    out = type(e)(e.code, str(e), e.reason, e.metadata)
    out.committed = tuple(committed)
    out.__cause__ = e
    return out


def _answer(got: dict[int, pb.LookupResponse] | None, i: int) -> pb.LookupResponse | None:
    return None if got is None else got[i]


def _rank(e: BaseException) -> int:
    if isinstance(e, OutcomeUnknown):
        return 0
    if isinstance(e, DirectoryError) and e.reason:
        return 1
    if isinstance(e, DirectoryError) and not isinstance(e, Unavailable):
        return 2
    return 3


def worst(errors: Sequence[BaseException]) -> BaseException:
    """The error a split call raises (see the module docstring); not a
    DirectoryError (a bug) always wins."""
    for e in errors:
        if not isinstance(e, DirectoryError):
            return e
    return min(errors, key=_rank)


class ShardedDirectoryClient(DirectoryRequests):
    def __init__(
        self,
        home: Sequence[str],
        timeout_s: float = 5.0,
        retry_unknown: bool = True,
        security: ClientSecurity = PLAIN,
        shard_map: ShardMap | None = None,
        workers_max: int = WORKERS_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`home`: gRPC addresses of the home group's replicas. `shard_map`: route
        by this map and never ask for another (tests, benchmarks of unsharded
        groups); else the home group's map, asked for now."""
        if not home:
            raise ValueError("at least one address of the shard home is required")
        self.addresses = list(home)
        self.timeout_s = timeout_s
        self.retry_unknown = retry_unknown
        self.security = security
        self._clock = clock
        self._static = shard_map is not None
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._groups: dict[str, DirectoryClient] = {}
        self._retired: list[DirectoryClient] = []
        self._down_until: dict[str, float] = {}
        self._asked_at = -float("inf")
        self._pool = ThreadPoolExecutor(max_workers=workers_max, thread_name_prefix="kvdir-shards")
        self._lookups = ThreadPoolExecutor(
            max_workers=workers_max, thread_name_prefix="kvdir-shard-lookups"
        )  # apart from writes: a lookup never queues behind a slow publish
        self.home = DirectoryClient(home, timeout_s, retry_unknown, security=security)
        self.map_refreshes = 0
        self.reroutes = 0
        self._known: ShardMap | None = None
        self._router: Router | None = None
        if shard_map is not None:
            self._install(shard_map)
        else:
            # Asked now, so a deployment error shows at start; if the home cannot
            # answer yet, the first call asks again (and raises if it still cannot).
            with contextlib.suppress(DirectoryError):
                self.refresh_map(0, force=True)

    # ------------------------------------------------------------------ map

    @property
    def shard_map(self) -> ShardMap:
        return self._map

    @property
    def _map(self) -> ShardMap:
        m = self._known
        if m is None:
            m = self.refresh_map(0, force=True)
        return m

    def _install(self, m: ShardMap) -> None:
        with self._lock:
            for g in m.groups:
                old = self._groups.get(g.group_id)
                if old is not None and old.addresses == list(g.replicas):
                    continue
                if old is not None:
                    self._retired.append(old)  # a call may still use it: closed at close()
                self._groups[g.group_id] = self._group_client(g)
            self._known = m

    def _group_client(self, g: Group) -> DirectoryClient:
        if list(g.replicas) == self.addresses:
            return self.home
        return DirectoryClient(
            g.replicas, self.timeout_s, self.retry_unknown, security=self.security
        )

    def refresh_map(self, min_version: int = 0, force: bool = False) -> ShardMap:
        """Ask the home group for its map (at least `min_version` when it has one);
        install it if newer. Bounded: without `force` or a version to reach, at
        most one ask per MAP_REFRESH_S_MIN."""
        if self._static:
            return self._map
        with self._refresh_lock:
            known = self._known
            if known is not None and min_version and known.version >= min_version:
                return known
            now = self._clock()
            recent = now - self._asked_at < MAP_REFRESH_S_MIN
            if known is not None and not force and not min_version and recent:
                return known
            self._asked_at = now
            m = self._ask_home(min_version)
            self.map_refreshes += 1
            if known is None or m.version > known.version:
                self._install(m)
            assert self._known is not None
            return self._known

    def _ask_home(self, min_version: int) -> ShardMap:
        try:
            resp: pb.GetShardMapResponse = self.home.call(
                "GetShardMap", pb.GetShardMapRequest(min_version=min_version)
            )
        except DirectoryError as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            resp = pb.GetShardMapResponse()  # a directory from before sharding
        if not resp.HasField("map"):
            # An unsharded home owns every key: one group, the home itself.
            gid = resp.group_id or UNSHARDED_GROUP
            return even_map([Group(gid, tuple(self.addresses))])
        try:
            return shard_wire.from_pb(resp.map)
        except ShardMapError as e:
            raise DirectoryError(
                grpc.StatusCode.INTERNAL, f"the home group sent a bad map: {e}"
            ) from e

    def _router_of(self, m: ShardMap) -> Router:
        """The lookup router of map `m` (remembers the groups of hashes seen)."""
        r = self._router
        if r is None or r.map is not m:
            r = self._router = Router(m)
        return r

    def _metadata(self) -> list[tuple[str, str]]:
        return [(shard_wire.SHARD_MAP_VERSION_KEY, str(self._map.version))]

    def group_client(self, group_id: str) -> DirectoryClient:
        return self._groups[group_id]

    def group_ids(self) -> list[str]:
        return [g.group_id for g in self._map.groups]

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        for c in {id(c): c for c in [self.home, *self._groups.values(), *self._retired]}.values():
            c.close()

    def __enter__(self) -> ShardedDirectoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def retries(self) -> int:
        return sum(c.retries for c in self._groups.values())

    def _deadline(self, timeout_s: float | None = None) -> float:
        return self._clock() + (timeout_s or self.timeout_s)

    def _left(self, deadline: float) -> float:
        left = deadline - self._clock()
        if left <= 0:
            raise Unavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "shard deadline passed")
        return left

    def _each(self, work: Mapping[str, Callable[[], T]]) -> dict[str, T | BaseException]:
        """Run one callable per group: in this thread when there is one, else in
        parallel on the pool. Every callable's result or exception, by group."""
        out: dict[str, T | BaseException] = {}
        if len(work) == 1:
            ((g, fn),) = work.items()
            try:
                out[g] = fn()
            except Exception as e:
                out[g] = e
            return out
        futures: dict[str, Future[T]] = {g: self._pool.submit(fn) for g, fn in work.items()}
        for g, f in futures.items():
            try:
                out[g] = f.result()
            except Exception as e:
                out[g] = e
        return out

    def _fan_out(self, method: str, request: Any, timeout_s: float | None = None) -> list[Any]:
        """`method` to every group (node-wide commands); raises the worst failure."""
        deadline = self._deadline(timeout_s)
        md = self._metadata()

        def send(c: DirectoryClient) -> Callable[[], Any]:
            return lambda: c.call(method, request, self._left(deadline), metadata=md)

        got = self._each({g: send(c) for g, c in self._clients().items()})
        errors = [r for r in got.values() if isinstance(r, BaseException)]
        if errors:
            raise worst(errors)
        return list(got.values())

    def _clients(self) -> dict[str, DirectoryClient]:
        with self._lock:
            return {g.group_id: self._groups[g.group_id] for g in self._map.groups}

    def _routed(
        self,
        hashes: Sequence[bytes],
        send: Callable[[DirectoryClient, list[int], float, list[tuple[str, str]]], T],
        timeout_s: float | None = None,
    ) -> list[T]:
        """Split `hashes` by group and `send(client, positions, timeout_s, metadata)`
        each part in parallel; re-split the parts refused as wrong_shard."""
        deadline = self._deadline(timeout_s)
        pending = list(range(len(hashes)))
        done: list[T] = []
        committed: list[int] = []
        for _ in range(REROUTE_ATTEMPTS_MAX):
            m, md = self._map, self._metadata()
            parts = {
                g: [pending[i] for i in idx]
                for g, idx in m.positions_by_group([hashes[i] for i in pending]).items()
            }
            clients = self._clients()

            got = self._each(
                {g: self._part(send, clients[g], idx, deadline, md) for g, idx in parts.items()}
            )
            wrong: list[int] = []
            errors: list[BaseException] = []
            for g, r in got.items():
                if isinstance(r, DirectoryError) and r.reason == shard_wire.REASON_WRONG_SHARD:
                    wrong += parts[g]
                    seen = shard_wire.version_of(r.metadata.items())
                    self._note_version(seen)
                elif isinstance(r, BaseException):
                    errors.append(r)
                else:
                    done.append(r)
                    committed += parts[g]
            if errors:
                e = worst(errors)
                if isinstance(e, DirectoryError):
                    # A fresh error per call: the parts that did commit (the caller
                    # need not send them again; resending would be harmless).
                    e = _with_committed(e, sorted(committed))
                raise e
            if not wrong:
                return done
            self.reroutes += 1
            self._left(deadline)
            self.refresh_map(m.version + 1 if self._map.version == m.version else 0)
            pending = sorted(wrong)
        raise Unavailable(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"still refused as wrong_shard after {REROUTE_ATTEMPTS_MAX} map refreshes",
            shard_wire.REASON_WRONG_SHARD,
        )

    def _part(
        self,
        send: Callable[[DirectoryClient, list[int], float, list[tuple[str, str]]], T],
        client: DirectoryClient,
        idx: list[int],
        deadline: float,
        md: list[tuple[str, str]],
    ) -> Callable[[], T]:
        return lambda: send(client, idx, self._left(deadline), md)

    def _note_version(self, seen: int) -> None:
        """A replica knows map `seen`: fetch it when it is newer than ours (bounded:
        the refresh is what the reroute loop does next anyway)."""
        if seen > self._map.version and not self._static:
            # On failure the reroute loop refreshes again or gives up within its deadline.
            with contextlib.suppress(DirectoryError):
                self.refresh_map(seen)

    # ------------------------------------------------------------- writes

    def _write(self, method: str, request: Any) -> Any:
        """A request `DirectoryRequests` built, routed by its kind (module docstring)."""
        if method == "Publish":
            return self._publish(request)
        if method == "Remove":
            return self._remove(request)
        return _MERGE[method](self._fan_out(method, request))

    def _publish(self, req: pb.PublishRequest) -> pb.PublishResponse:
        n = len(req.block_hashes)
        if any(len(getattr(req, c)) != n for c in _PUBLISH_COLUMNS):
            # One part per group cannot be cut from ragged columns: let a replica say why.
            first = self._clients()[self._map.groups[0].group_id]
            return cast(pb.PublishResponse, first.call("Publish", req))
        if not n:  # an empty batch goes to the home group alone (it still checks the node)
            return cast(pb.PublishResponse, self.home.call("Publish", req))
        parts: list[pb.PublishResponse] = self._split("Publish", req, _PUBLISH_COLUMNS)
        return pb.PublishResponse(
            applied=sum(p.applied for p in parts),
            stale=sum(p.stale for p in parts),
            applied_index=max(p.applied_index for p in parts),
        )

    def _remove(self, req: pb.RemoveRequest) -> pb.RemoveResponse:
        if not req.block_hashes:
            node_wide = pb.RemoveRequest()
            node_wide.CopyFrom(req)
            node_wide.ClearField("generations")  # as ever: a node-wide remove has no columns
            node_wide.ClearField("addresses")
            got: list[pb.RemoveResponse] = self._fan_out("Remove", node_wide)
            return pb.RemoveResponse(removed=sum(r.removed for r in got))
        parts: list[pb.RemoveResponse] = self._split("Remove", req, _REMOVE_COLUMNS)
        return pb.RemoveResponse(
            removed=sum(p.removed for p in parts),
            applied_index=max(p.applied_index for p in parts),
        )

    def _split(self, method: str, req: R, columns: tuple[str, ...]) -> list[Any]:
        """`req` cut by the groups of its hashes, each part sent to its group."""
        hashes = list(req.block_hashes)
        part = _parts(req, columns)

        def send(c: DirectoryClient, idx: list[int], left: float, md: list[tuple[str, str]]) -> Any:
            return c.call(method, part(idx), left, metadata=md)

        return self._routed(hashes, send)

    # -------------------------------------------------------------- reads

    def _lookup(
        self, req: pb.LookupRequest, chain: Sequence[bytes], address: str | None
    ) -> pb.LookupResponse:
        return self.lookup_message(req, list(chain), address)

    def lookup_message(
        self, req: pb.LookupRequest, chain: list[bytes] | None = None, address: str | None = None
    ) -> pb.LookupResponse:
        """The merged answer to one LookupRequest (any wire form of the chain)."""
        if address is not None:
            return cast(
                pb.LookupResponse, self._by_address(address).call("Lookup", req, address=address)
            )
        hashes = chain_hashes(req) if chain is None else chain
        if not hashes:
            return cast(pb.LookupResponse, self.home.call("Lookup", req))  # it says what is wrong
        return self.lookup_batch([req], req.linearizable, _chains=[hashes]).results[0]

    def lookup_batch(
        self,
        lookups: Sequence[pb.LookupRequest],
        linearizable: bool = False,
        address: str | None = None,
        _chains: Sequence[list[bytes]] | None = None,
    ) -> pb.LookupBatchResponse:
        """As the LookupBatch RPC: each lookup split by group, one batch per group,
        the groups asked in parallel, each lookup's answers merged."""
        if address is not None:
            return self._by_address(address).lookup_batch(lookups, linearizable, address)
        chains = list(_chains) if _chains is not None else [chain_hashes(r) for r in lookups]
        if any(not c for c in chains):
            return self.home.lookup_batch(lookups, linearizable)  # the home says what is wrong
        for _ in range(REROUTE_ATTEMPTS_MAX):
            m, md = self._map, self._metadata()
            router = self._router_of(m)
            positions = [router.positions(c) for c in chains]
            got = self._lookup_groups(lookups, chains, positions, linearizable, md)
            if got is None:
                self.reroutes += 1
                self.refresh_map(m.version + 1 if self._map.version == m.version else 0)
                continue
            out = pb.LookupBatchResponse()
            for i, (req, pos) in enumerate(zip(lookups, positions, strict=True)):
                answers = {g: _answer(got[g], i) for g in pos}
                if len(pos) == 1:
                    (only,) = answers.values()
                    if only is not None:  # one group owns the whole chain: its answer is final
                        out.results.add().CopyFrom(only)
                        continue
                merged = merge_lookup(
                    len(chains[i]),
                    pos,
                    answers,
                    req.max_nodes or _DEFAULT_NODES,
                    req.omit_records,
                )
                out.results.add().CopyFrom(merged)
            return out
        raise Unavailable(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"lookups still refused as wrong_shard after {REROUTE_ATTEMPTS_MAX} map refreshes",
            shard_wire.REASON_WRONG_SHARD,
        )

    def _lookup_groups(
        self,
        lookups: Sequence[pb.LookupRequest],
        chains: Sequence[list[bytes]],
        positions: Sequence[Mapping[str, Positions]],
        linearizable: bool,
        md: list[tuple[str, str]],
    ) -> dict[str, dict[int, pb.LookupResponse] | None] | None:
        """Each group's answers by lookup index (None: the group could not answer);
        None when a group refused as wrong_shard (refresh and route again)."""
        asks: dict[str, dict[int, pb.LookupRequest]] = {}
        for i, (req, pos) in enumerate(zip(lookups, positions, strict=True)):
            for g, idx in pos.items():
                sub = lookup_request(
                    req.namespace,
                    chains[i] if len(pos) == 1 else [chains[i][j] for j in idx],
                    req.max_nodes,
                    req.exclude_node,
                    req.omit_records,
                )
                asks.setdefault(g, {})[i] = sub
        clients = self._clients()
        now = self._clock()
        timeout = min(self.timeout_s, LOOKUP_TIMEOUT_S_MAX)

        calls: dict[str, tuple[str, Any]] = {}
        with self._lock:
            for g, subs in asks.items():
                down = self._down_until.get(g)
                if down is not None and down > now:
                    continue  # known down: a miss, no wait
                if down is not None:
                    self._down_until[g] = now + GROUP_DOWN_S  # this call is the one probe
                if len(subs) == 1:
                    (sub,) = subs.values()
                    sub.linearizable = linearizable
                    calls[g] = ("Lookup", sub)
                else:
                    batch = pb.LookupBatchRequest(
                        lookups=list(subs.values()), linearizable=linearizable
                    )
                    calls[g] = ("LookupBatch", batch)
        got: dict[str, Any] = {}
        for g, r in self._ask_all(calls, clients, timeout, md).items():
            if isinstance(r, pb.LookupResponse):
                got[g] = {next(iter(asks[g])): r}
            elif isinstance(r, pb.LookupBatchResponse):
                got[g] = dict(zip(asks[g], r.results, strict=True))
            else:
                got[g] = r
        out: dict[str, dict[int, pb.LookupResponse] | None] = {g: None for g in asks}
        for g, r in got.items():
            if isinstance(r, DirectoryError) and r.reason == shard_wire.REASON_WRONG_SHARD:
                self._up(g)
                self._note_version(shard_wire.version_of(r.metadata.items()))
                return None
            if isinstance(r, DirectoryError) and r.code == grpc.StatusCode.INVALID_ARGUMENT:
                self._up(g)
                raise r  # a bad request is the caller's, whichever group saw it
            if isinstance(r, DirectoryError) and r.reason == shard_wire.REASON_SHARD_MOVING:
                # A shard of this group is being moved: its blocks are absent for this
                # call (a miss); the group is up, and the map changes when the move ends.
                self._up(g)
                self._note_version(shard_wire.version_of(r.metadata.items()))
                continue
            if isinstance(r, DirectoryError):
                with self._lock:  # unavailable: its blocks count as absent
                    self._down_until[g] = self._clock() + GROUP_DOWN_S
                continue
            if isinstance(r, BaseException):
                raise r
            self._up(g)
            out[g] = r
        return out

    def _ask_all(
        self,
        calls: Mapping[str, tuple[str, Any]],
        clients: Mapping[str, DirectoryClient],
        timeout_s: float,
        md: list[tuple[str, str]],
    ) -> dict[str, Any]:
        """Every group's (method, request) at once, each a blocking call on the
        replica its client prefers, made by the lookup pool's threads; a part that
        fails goes again through the group's retrying client, whose error (or
        answer) is that part's.

        Not gRPC futures: a sync channel with no call in flight starts a new thread
        for each future's completion, and those starts cost more than handing a
        blocking call to a pool thread (4 groups, 2-core host, 2026-12-05: p50
        3.3-4.6 ms with futures, 2.8-3.1 ms with the pool; client CPU 1.8-2.2 ->
        1.3 ms a lookup)."""
        futures = {}
        for g, (method, req) in calls.items():
            c = clients[g]
            stub = getattr(c.stub(c.preferred()), method)
            futures[g] = self._lookups.submit(stub, req, timeout=timeout_s, metadata=md)
        out: dict[str, Any] = {}
        for g, f in futures.items():
            try:
                out[g] = f.result()
            except grpc.RpcError:
                method, req = calls[g]
                try:
                    out[g] = clients[g].call(method, req, timeout_s, metadata=md)
                except Exception as e:
                    out[g] = e
        return out

    def _up(self, g: str) -> None:
        if g in self._down_until:
            with self._lock:
                self._down_until.pop(g, None)

    def list_nodes(self, address: str | None = None) -> pb.ListNodesResponse:
        """Every group's nodes, merged by node id (entries summed, the earliest lease)."""
        if address is not None:
            return self._by_address(address).list_nodes(address)
        got: list[pb.ListNodesResponse] = self._fan_out("ListNodes", pb.ListNodesRequest())
        nodes: dict[str, pb.NodeInfo] = {}
        for resp in got:
            for n in resp.nodes:
                have = nodes.get(n.node_id)
                if have is None:
                    nodes[n.node_id] = pb.NodeInfo()
                    nodes[n.node_id].CopyFrom(n)
                    continue
                have.entries += n.entries
                have.lease_expiry_ms = min(have.lease_expiry_ms, n.lease_expiry_ms)
        return pb.ListNodesResponse(nodes=[nodes[k] for k in sorted(nodes)])

    def status(self, address: str) -> pb.ClusterStatusResponse:
        return self._by_address(address).status(address)

    def _by_address(self, address: str) -> DirectoryClient:
        for c in self._clients().values():
            if address in c.addresses:
                return c
        return self.home


AnyDirectoryClient = DirectoryClient | ShardedDirectoryClient
"""What agents and tools hold: one group's client, or the sharded one (same surface)."""


def directory_client(
    replicas: Sequence[str],
    shard_home: Sequence[str],
    timeout_s: float = 5.0,
    security: ClientSecurity = PLAIN,
) -> AnyDirectoryClient:
    """The sharded client when a shard home is configured, else one group's client."""
    if shard_home:
        return ShardedDirectoryClient(shard_home, timeout_s=timeout_s, security=security)
    return DirectoryClient(replicas, timeout_s=timeout_s, security=security)
