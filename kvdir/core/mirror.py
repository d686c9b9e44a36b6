"""An in-process mirror of the directory: lookups at memory speed.

A `Mirror` applies a replica's Watch stream (kvdir.v1.PrefixDirectory/Watch)
to its own `Table`, the replicas' own state machine, so replaying the same
committed commands gives the same table, and answers `lookup` /
`lookup_batch` in process with the same messages as the RPCs
(`directory/answer.py` builds both). `kvdir.core.mirror_sync.MirrorSync`
keeps it fed; `MirroredDirectory` is what callers use: the mirror while it is
fresh, the RPC otherwise.

Guarantee: a mirror's reads are a prefix of the committed log and never go
backwards. Every command it applies was applied by a replica, and replicas
apply only committed commands, in log order, so the table is always the
table of the committed log at `applied_index`; `applied_index` only grows (a
snapshot older than what the mirror has is dropped, and commands at or
below `applied_index` are skipped, whichever replica sends them). How far
behind it may be is what `lag()` says. All of this holds within one cluster's
log: every event names its cluster (`cluster_id`), and a mirror whose table
came from another one (a `kvdir directory restore` gave the cluster a new id)
forgets its table, stops serving and raises `Resync`, so it starts again from
a snapshot of the new log; only then may its applied index be lower. A
stale answer is safe: it can name a block that has since moved or gone, and
every reader validates the generation of what it read before using it
(docs/agent.md), so staleness costs a miss or a wasted transfer, never wrong
data.

A mirror filtered to some namespaces (`namespaces`, the same list its stream
asks for) holds the table of those namespaces' commands and every node-wide
one: its snapshot carries only their entries and every node (the replica
narrows it, `directory/snapshot.py` `restrict`), so it answers for them
exactly as a replica does and holds nothing else. Its `digest` is then that
filtered table's, not a replica's.

Staleness: `fresh()` is false before the first starting point, when no
message came for `max_staleness_s`, or when the oldest committed command not
yet applied was heard of more than `max_staleness_s` ago; lookups then raise
`NotServed` and callers ask a replica.

Thread-safety: `on_event` runs on the stream's thread; lookups on any thread.
Commands are applied under `lock`, and a snapshot is loaded outside it and
swapped in, so a lookup waits at most one command's apply.
"""

from __future__ import annotations

import io
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from kvdir.core.client import DirectoryError, lookup_request
from kvdir.directory import answer, codec, snapshot, validate
from kvdir.directory.commands import Command
from kvdir.directory.limits import RequestLimits
from kvdir.directory.lookup import Chain
from kvdir.directory.table import Match, NodeState, Table
from kvdir.v1 import directory_pb2 as pb

MAX_STALENESS_S_DEFAULT = 1.0
COMMITS_TRACKED_MAX = 4096
"""Commit indexes (with when they were heard) kept to measure lag in time."""
APPLY_BYTES_PER_LOCK = 64 * 1024
"""Encoded commands applied per hold of the mirror's lock (~2,000 published blocks:
a lookup waits for at most about that much apply work)."""
SNAPSHOT_BYTES_MAX = 16 * 1024 * 1024 * 1024
"""A snapshot bigger than this is refused (a corrupt header or a hostile replica)."""


class NotServed(Exception):
    """The mirror cannot answer this lookup; ask a replica (`reason` says why)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class MirrorError(Exception):
    """The stream is not something this mirror can apply (it stops, stale)."""


class Resync(Exception):
    """The stream is another cluster's log: reconnect, from a snapshot (`resume_index` is 0)."""


@dataclass(frozen=True, slots=True)
class Lag:
    applied_index: int
    commit_index: int
    """The leader's commit index, as last heard from the replica."""
    entries: int
    ms: float
    """How long ago the oldest committed but unapplied index was heard of (0: caught up)."""
    silent_ms: float
    """Since the last message from the stream."""
    fresh: bool


class ChainLookups:
    """`lookup` by chain for every in-process reader (a mirror, a sharded
    directory's mirror, a mirror with the replicas as fallback): the request
    built once (`lookup_request`), answered by the reader's `lookup_message`."""

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        raise NotImplementedError

    def lookup(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        max_nodes: int = 0,
        exclude_node: str = "",
        omit_records: bool = False,
    ) -> pb.LookupResponse:
        """As `DirectoryClient.lookup` (local read), answered in process."""
        return self.lookup_message(lookup_request(ns, chain, max_nodes, exclude_node, omit_records))


def parse_lookup(req: pb.LookupRequest, limits: RequestLimits) -> tuple[str, Chain, int]:
    """`req` checked as a replica checks it: (namespace key, chain, max nodes)."""
    try:
        return validate.lookup_chain(req, limits)
    except validate.BadRequest as e:
        raise DirectoryError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.reason) from e


def check_batch(lookups: Sequence[pb.LookupRequest], limits: RequestLimits) -> None:
    """Refuses a batch a replica would refuse for its size."""
    if len(lookups) > limits.lookup_batch_max:
        raise DirectoryError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(lookups)} lookups is over the limit of {limits.lookup_batch_max}",
            "too-many-lookups",
        )


class Mirror(ChainLookups):
    def __init__(
        self,
        max_staleness_s: float = MAX_STALENESS_S_DEFAULT,
        namespaces: Iterable[pb.Namespace] = (),
        clock: Callable[[], float] = time.monotonic,
        limits: RequestLimits | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.table = Table()
        self.applied_index = 0
        self.commit_index = 0
        self.ready = False
        """Whether the mirror has a starting point (a snapshot, or commands from 0)."""
        self.cluster_id: str | None = None
        """The cluster whose log the table is of (None before a starting point)."""
        self.resyncs = 0
        """Times the stream turned out to be another cluster's (see `Resync`)."""
        self.source = ""
        self.max_staleness_s = max_staleness_s
        self.watched = list(namespaces)
        """What its Watch stream asks for (all namespaces when empty)."""
        self.namespaces = frozenset(validate.namespace_key(ns) for ns in self.watched) or None
        self.limits = limits or RequestLimits()
        self._clock = clock
        self._heard = -float("inf")
        self._commits: deque[tuple[int, float]] = deque()
        self._snap = bytearray()
        self._snap_index = 0
        self.snapshots = 0
        self.error = ""

    # ------------------------------------------------------------ stream side

    def resume_index(self) -> int:
        """The from_index of a (re)connection: where we are, or 0 for a snapshot.

        Drops a half-received snapshot (the stream it came on is gone)."""
        self._snap = bytearray()
        return self.applied_index if self.ready else 0

    def on_event(self, ev: pb.WatchEvent) -> None:
        """Apply one Watch event (raises MirrorError on a stream it cannot apply)."""
        if ev.command_version and ev.command_version != codec.VERSION:
            raise MirrorError(
                f"the replica sends command format {ev.command_version}; "
                f"this mirror applies {codec.VERSION}"
            )
        now = self._clock()
        kind = ev.WhichOneof("event")
        if self.ready and ev.cluster_id != self.cluster_id:
            self._forget(ev.cluster_id, ev.replica_id)
            if kind != "snapshot":  # a snapshot is itself the new starting point
                raise Resync(
                    f"replica {ev.replica_id!r} serves cluster {ev.cluster_id!r}, "
                    f"the mirror's table is of {self.cluster_id!r}"
                )
        # The event's commit index covers everything it carries: heard before anything
        # is applied, so no reader sees an applied index past the commit index it knows.
        self._heard_commit(ev.commit_index, now)
        if kind == "snapshot":
            self._on_snapshot(ev.snapshot, ev.cluster_id)
        elif kind == "entries":
            self._on_entries(ev.entries)
        if self.ready and not self._snap:
            with self.lock:
                self.applied_index = max(self.applied_index, ev.applied_index)
        self.source = ev.replica_id

    def _forget(self, cluster_id: str, replica_id: str) -> None:
        """Another cluster's stream: drop this table and every index heard from the old log."""
        with self.lock:
            self.ready = False
            self.table = Table()
            self.applied_index = 0
            self.commit_index = 0
        self._commits.clear()
        self._snap = bytearray()
        self.resyncs += 1
        self.error = f"replica {replica_id!r} serves cluster {cluster_id!r}: resynchronising"

    def _on_snapshot(self, s: pb.WatchSnapshot, cluster_id: str) -> None:
        if not self._snap:
            if s.total_bytes > SNAPSHOT_BYTES_MAX:
                raise MirrorError(f"a snapshot of {s.total_bytes} bytes is over the limit")
            self._snap_index = s.index
        elif s.index != self._snap_index:
            raise MirrorError(f"snapshot chunk of index {s.index} inside {self._snap_index}'s")
        self._snap += s.data
        if not s.last:
            return
        data, self._snap = bytes(self._snap), bytearray()
        if len(data) != s.total_bytes:
            raise MirrorError(f"snapshot of {len(data)} bytes, announced {s.total_bytes}")
        if self.ready and s.index <= self.applied_index:
            return  # older than what we have: keep ours (reads never go backwards)
        try:
            table, _, _ = snapshot.load(io.BytesIO(data), "watch snapshot")
        except (snapshot.SnapshotError, ValueError, KeyError) as e:
            raise MirrorError(f"bad snapshot: {e}") from e
        with self.lock:
            self.table = table
            self.applied_index = s.index
            self.ready = True
            self.cluster_id = cluster_id
        self.snapshots += 1

    def _on_entries(self, e: pb.WatchEntries) -> None:
        if len(e.indexes) != len(e.commands):
            raise MirrorError(f"{len(e.indexes)} indexes for {len(e.commands)} commands")
        if not self.ready:
            raise MirrorError("commands before any starting point (a snapshot)")
        todo: list[tuple[int, Command, int]] = []
        for index, blob in zip(e.indexes, e.commands, strict=True):
            if index <= self.applied_index:
                continue  # already applied (another replica's stream sent it)
            try:
                todo.append((index, codec.decode(blob), len(blob)))
            except codec.CodecError as err:
                raise MirrorError(f"command at index {index}: {err}") from err
        # Decoded outside the lock; applied under it a bounded chunk at a time, so
        # a lookup waits for at most one chunk and the lock changes hands rarely.
        i = 0
        while i < len(todo):
            size = 0
            with self.lock:
                while i < len(todo) and (size == 0 or size + todo[i][2] <= APPLY_BYTES_PER_LOCK):
                    index, cmd, n = todo[i]
                    self.table.apply(cmd)
                    self.applied_index = index
                    size += n
                    i += 1

    def _heard_commit(self, commit_index: int, now: float) -> None:
        self._heard = now
        if commit_index > self.commit_index:
            self.commit_index = commit_index
            self._commits.append((commit_index, now))
            if len(self._commits) > COMMITS_TRACKED_MAX:
                self._commits.popleft()

    def fail(self, message: str) -> None:
        """Record why the stream stopped (shown by `lag` callers, logs)."""
        self.error = message

    # ----------------------------------------------------------- staleness

    def lag(self) -> Lag:
        now = self._clock()
        applied = self.applied_index
        behind_ms = self._behind_ms(now, applied)
        silent_ms = (now - self._heard) * 1000
        limit_ms = self.max_staleness_s * 1000
        fresh = self.ready and silent_ms <= limit_ms and behind_ms <= limit_ms
        entries = max(0, self.commit_index - applied)
        return Lag(applied, self.commit_index, entries, behind_ms, silent_ms, fresh)

    def _behind_ms(self, now: float, applied: int) -> float:
        """How long ago the oldest commit index past `applied` was heard of (0: none)."""
        while self._commits and self._commits[0][0] <= applied:
            self._commits.popleft()
        return (now - self._commits[0][1]) * 1000 if self._commits else 0.0

    def fresh(self) -> bool:
        """`lag().fresh`, with no `Lag` built: a sharded mirror asks it of every group
        of every lookup."""
        now = self._clock()
        limit_ms = self.max_staleness_s * 1000
        if not self.ready or (now - self._heard) * 1000 > limit_ms:
            return False
        return self._behind_ms(now, self.applied_index) <= limit_ms

    def _check(self, ns_key: str) -> None:
        lag = self.lag()
        if not lag.fresh:
            why = (
                "not started"
                if not self.ready
                else f"{lag.ms:.0f} ms behind, silent {lag.silent_ms:.0f} ms"
            )
            raise NotServed("stale", f"the mirror is stale ({why}); ask a replica")
        if self.namespaces is not None and ns_key not in self.namespaces:
            raise NotServed("namespace-not-mirrored", "this mirror does not hold that namespace")

    # ----------------------------------------------------------------- reads

    def read_info(self) -> pb.ReadInfo:
        info = pb.ReadInfo()
        self._fill_read(info)
        return info

    def _fill_read(self, info: pb.ReadInfo) -> None:
        """Set `info` in place (a response's own field: no message built and copied)."""
        info.replica_id = f"mirror:{self.source}"
        info.applied_index, info.commit_index = self.read_indexes()

    def read_indexes(self) -> tuple[int, int]:
        """(applied index, commit index) that a read made now reflects (under `lock`)."""
        return self.applied_index, max(self.commit_index, self.applied_index)

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        """The answer a replica gives to `req` (local read), from this mirror.

        Raises NotServed when stale, DirectoryError(INVALID_ARGUMENT) for a
        request a replica would refuse. `linearizable` cannot be honoured here."""
        if req.linearizable:
            raise NotServed("linearizable", "a mirror serves local reads only")
        ns, chain, max_nodes = parse_lookup(req, self.limits)
        self._check(ns)
        resp = pb.LookupResponse()
        with self.lock:
            matches = self.matches(ns, chain, max_nodes, req.exclude_node)
            answer.fill(resp.matches, self.table, matches, req.omit_records)
            self._fill_read(resp.read)  # the index this answer reflects
        return resp

    def lookup_batch(self, lookups: Sequence[pb.LookupRequest]) -> pb.LookupBatchResponse:
        """As the LookupBatch RPC (local read): results[i].read unset, one ReadInfo."""
        check_batch(lookups, self.limits)
        parsed = [parse_lookup(lk, self.limits) for lk in lookups]
        for ns, _, _ in parsed:
            self._check(ns)
        resp = pb.LookupBatchResponse()
        with self.lock:
            for lk, (ns, chain, max_nodes) in zip(lookups, parsed, strict=True):
                matches = self.matches(ns, chain, max_nodes, lk.exclude_node)
                answer.fill(resp.results.add().matches, self.table, matches, lk.omit_records)
            self._fill_read(resp.read)
        return resp

    def holders(
        self, ns_key: str, chain: Chain, max_nodes: int
    ) -> list[tuple[str, int, str, frozenset[str]]]:
        """(node id, prefix blocks, host, transports) best first: the routing answer,
        with no message built. `ns_key` is kvdir.core.wire.namespace_key's; raises
        NotServed when stale or not mirrored."""
        self._check(ns_key)
        with self.lock:
            return [
                (m.node.node_id, m.prefix_blocks, m.node.host, frozenset(m.node.transports))
                for m in self.matches(ns_key, chain, max_nodes)
            ]

    def prefix_lengths(self, ns_key: str, chain: Chain, max_nodes: int) -> list[tuple[str, int]]:
        """(node id, prefix blocks) best first, as `holders` without the node details:
        the lightest read, for routers that weigh holders by prefix length only."""
        self._check(ns_key)
        with self.lock:
            if self._moving(chain):
                return []
            return self.table.prefix_lengths(ns_key, chain, max_nodes)

    def matches(
        self, ns_key: str, chain: Chain, max_nodes: int, exclude_node: str = ""
    ) -> list[Match]:
        """The table's matches for `chain`, under `lock`: none when a block of it is in
        a shard this group's log has fenced (moving away, maybe partly dropped, or
        still importing), as a replica refuses that lookup (`shard_moving`)."""
        if self._moving(chain):
            return []
        return self.table.lookup(ns_key, chain, max_nodes, exclude_node)

    def holder_prefixes(
        self, ns_key: str, chain: Chain, max_nodes: int, exclude_node: str = ""
    ) -> list[tuple[NodeState, Sequence[int]]]:
        """`matches` as the table's `holder_prefixes` (in no set order), under `lock`."""
        if self._moving(chain):
            return []
        return self.table.holder_prefixes(ns_key, chain, max_nodes, exclude_node)

    def _moving(self, chain: Chain) -> bool:
        fence = self.table.fence
        return bool(fence) and fence.lookup_refusal(chain.items()) is not None

    def digest(self) -> tuple[int, bytes]:
        """(applied index, the table's digest at it): an unfiltered mirror's equals
        ClusterStatus's at the same index (a filtered one's is its namespaces' table)."""
        with self.lock:
            return self.applied_index, self.table.digest()


class LocalLookups(Protocol):
    """An in-process answerer: a `Mirror`, or a sharded directory's mirror."""

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse: ...

    def lookup_batch(self, lookups: Sequence[pb.LookupRequest]) -> pb.LookupBatchResponse: ...


class RpcLookups(Protocol):
    """The replicas' answers: a `DirectoryClient`, or a sharded directory's client."""

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse: ...

    def lookup_batch(
        self, lookups: Sequence[pb.LookupRequest], linearizable: bool = False
    ) -> pb.LookupBatchResponse: ...


class MirroredDirectory(ChainLookups):
    """Lookups from a mirror while it is fresh, else from a replica over gRPC.

    The API the vLLM connector's scheduler side and the agent use: the same
    answers either way (`LookupResponse`), `ReadInfo.replica_id` telling
    which ("mirror:<replica>" when in process)."""

    def __init__(self, mirror: LocalLookups | None, client: RpcLookups) -> None:
        self.mirror = mirror
        self.client = client
        self.fallbacks = 0

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        if self.mirror is not None:
            try:
                return self.mirror.lookup_message(req)
            except NotServed:
                self.fallbacks += 1
        return self.client.lookup_message(req)

    def lookup_batch(self, lookups: Sequence[pb.LookupRequest]) -> pb.LookupBatchResponse:
        if self.mirror is not None:
            try:
                return self.mirror.lookup_batch(lookups)
            except NotServed:
                self.fallbacks += 1
        return self.client.lookup_batch(lookups)
