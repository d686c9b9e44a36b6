"""The gRPC face of a directory replica: kvdir.v1.PrefixDirectory.

Request handling is: validate (INVALID_ARGUMENT before anything is proposed),
then either propose through Raft (writes) or read the local table under the
replica lock (lookups; after a batched barrier when linearizable).

Error contract (also in the .proto and docs/directory.md):

- INVALID_ARGUMENT: malformed, over a limit, or refused by the state machine
  (unknown node, stale incarnation); trailing metadata ``kvdir-reason``.
- UNAVAILABLE: no leader / no quorum, not the leader (only the leader takes
  a write), or Raft definitely did not apply the write; ``kvdir-outcome:
  not-applied`` and ``kvdir-leader`` (gRPC address of the leader, when
  known). Safe to retry.
- ABORTED or DEADLINE_EXCEEDED with ``kvdir-outcome: unknown``: the write may
  or may not have committed. Every write is idempotent, so retry it.
- RESOURCE_EXHAUSTED: too many writes waiting on Raft; retry with backoff.
- UNAUTHENTICATED (secure mode): no or bad credentials (directory.security).
- PERMISSION_DENIED (secure mode): a write for a node the caller is not.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from kvdir.core import shard_wire
from kvdir.core.security import authorize_node
from kvdir.directory import answer, snapshot, validate
from kvdir.directory.commands import (
    ClearNode,
    Expired,
    ExpireNodes,
    Heartbeat,
    Published,
    Registered,
    RegisterNode,
    Reject,
    Rejected,
    Removed,
    Renewed,
    Result,
)
from kvdir.directory.config import DirectoryConfig
from kvdir.directory.consensus.port import Consensus, Outcome, Role
from kvdir.directory.limits import EXPIRE_NODES_PER_COMMAND_MAX
from kvdir.directory.metrics import DirectoryMetrics
from kvdir.directory.shard_service import ShardGuard
from kvdir.directory.shard_view import ShardView
from kvdir.directory.table import Match, Table
from kvdir.directory.watch import WatchService
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.directory.server")

SERVICE_NAME = "kvdir.v1.PrefixDirectory"
DIGEST_CAPTURE_TIMEOUT_S = 10.0
"""How long a digest waits for the Raft thread to freeze the table between applies."""
DIGEST_WAIT_S = 30.0
"""How long a digest request waits for another one on this replica to finish."""
_ROLE = {
    Role.FOLLOWER: pb.ROLE_FOLLOWER,
    Role.CANDIDATE: pb.ROLE_CANDIDATE,
    Role.LEADER: pb.ROLE_LEADER,
}
_REJECT_REASON = {
    1: "unknown-node",
    2: "stale-incarnation",
    3: "bad-tier",
    4: "bad-batch",
    5: "stale_version",
    6: "bad_shard_map",
    7: "wrong_shard",
    8: "bad_move",
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Clock(Protocol):
    def now_ms(self) -> int: ...


class WallClock:
    """Milliseconds since the epoch; the leader stamps this into commands."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


def _rpc(
    method: Callable[[Any, Req, grpc.ServicerContext], Resp],
) -> Callable[[Any, Req, grpc.ServicerContext], Resp]:
    """Count and time an RPC, and turn a validation error into INVALID_ARGUMENT."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: DirectoryService, request: Req, context: grpc.ServicerContext) -> Resp:
        t0 = time.perf_counter()
        try:
            return method(self, request, context)
        except validate.BadRequest as e:
            context.set_trailing_metadata((("kvdir-reason", e.reason),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            code = context.code() or grpc.StatusCode.OK  # type: ignore[attr-defined]
            self.metrics.rpcs.labels(name, code.name).inc()
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - t0)

    return wrapper


class DirectoryService(pb_grpc.PrefixDirectoryServicer):
    """The PrefixDirectory RPCs over any `Consensus` (Raft in the daemon, memory in tests)."""

    def __init__(
        self,
        cfg: DirectoryConfig,
        consensus: Consensus,
        metrics: DirectoryMetrics,
        clock: Clock,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.limits = cfg.limits
        self.consensus = consensus
        self.metrics = metrics
        self._grpc_of_raft = cfg.grpc_of_raft()
        self._inflight = threading.BoundedSemaphore(cfg.limits.inflight_writes_max)
        self._digest_slot = threading.BoundedSemaphore(1)
        self._caught_up = False
        self.watch: WatchService | None = None
        """Set by the daemon once the Watch feed is attached."""
        self.shards = ShardGuard(ShardView(cfg.group, sharded=False), None)
        """Replaced by the daemon on a sharded replica (shard_service.py)."""

    # --------------------------------------------------------------- helpers

    def leader_grpc(self) -> str:
        leader = self.consensus.status().leader
        return "" if leader is None else self.label(leader)[1]

    def label(self, raft_address: str) -> tuple[str, str]:
        """(replica id, gRPC address) of a member: from the config, else from the membership."""
        grpc_addr = self._grpc_of_raft.get(raft_address)
        if grpc_addr is not None:
            return self.cfg.replica_of_raft()[raft_address], grpc_addr
        for m in self.consensus.members():
            if m.address == raft_address:
                return m.replica_id or raft_address, m.grpc_address
        return raft_address, ""

    def _authorize(self, node_id: str, context: grpc.ServicerContext) -> None:
        """A write names its node; only that node (or an admin) may make it."""
        authorize_node(context, node_id, self.cfg.auth.admins)

    def _unavailable(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        context.set_trailing_metadata(
            (("kvdir-outcome", "not-applied"), ("kvdir-leader", self.leader_grpc()))
        )
        context.abort(grpc.StatusCode.UNAVAILABLE, message)

    def _timeout_s(self, context: grpc.ServicerContext, limit_ms: int) -> float:
        remaining = context.time_remaining()
        limit = limit_ms / 1000
        return limit if remaining is None else max(0.0, min(limit, remaining))

    def _write(self, cmd: Any, context: grpc.ServicerContext) -> Result:
        # Only the leader takes a write: one a follower forwarded could reach the log
        # after the client's retry and its next write (docs/directory.md, "Writes").
        status = self.consensus.status()
        if status.leader is None:
            self._unavailable(context, "no leader: the directory has no quorum right now")
        if status.role is not Role.LEADER:
            self._unavailable(context, "not the leader: writes go to the leader (kvdir-leader)")
        if not self._inflight.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"over {self.limits.inflight_writes_max} writes waiting on raft",
            )
        try:
            res = self.consensus.write(cmd, self._timeout_s(context, self.limits.write_timeout_ms))
        finally:
            self._inflight.release()
        self.metrics.write_outcomes.labels(res.outcome.value).inc()
        if res.outcome is Outcome.NOT_APPLIED:
            self._unavailable(context, f"not applied: {res.reason}")
        if res.outcome is Outcome.UNKNOWN:
            context.set_trailing_metadata(
                (("kvdir-outcome", "unknown"), ("kvdir-leader", self.leader_grpc()))
            )
            expired = context.time_remaining() <= 0  # 0 once past the deadline, never None
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.ABORTED
            context.abort(code, f"outcome unknown: {res.reason}; the write is idempotent, retry it")
        result = res.result
        if isinstance(result, Rejected):
            reason = _REJECT_REASON[result.reason]
            if result.reason is Reject.SHARD_FENCED:  # a shard moving here or away: see the map
                version = str(self.shards.view.version)
                context.set_trailing_metadata(
                    (("kvdir-reason", reason), (shard_wire.SHARD_MAP_VERSION_KEY, version))
                )
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, result.message)
            context.set_trailing_metadata((("kvdir-reason", reason),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, result.message)
        assert result is not None
        return result

    def read_info(self, linearizable: bool) -> pb.ReadInfo:
        st = self.consensus.status()
        return pb.ReadInfo(
            replica_id=self.cfg.replica_id,
            role=_ROLE[st.role],
            applied_index=st.applied_index,
            commit_index=st.commit_index,
            linearizable=linearizable,
        )

    def observe_catch_up(self) -> bool:
        """Whether this replica has caught up since its start (lifting the gate
        once it has). The daemon's health loop calls this every tick, so a
        replica that serves no local read before it loses its quorum has still
        lifted the gate while it could see a leader."""
        if self._caught_up:
            return True
        st = self.consensus.status()
        if st.leader is None or st.lag > self.limits.local_read_lag_max:
            return False
        self._caught_up = True
        return True

    def _check_caught_up(self, context: grpc.ServicerContext) -> None:
        """Refuse local reads from a replica still replaying after its start.

        A restarted replica's table is what its journal replay has reached;
        until it has heard a leader and applied to within `local_read_lag_max`
        of its commit index, a local read could see minutes-old state. The gate
        lifts once and stays lifted: in steady state a follower's lag is the
        ReadInfo the caller gets, not a reason to refuse.
        """
        if self.observe_catch_up():
            return
        st = self.consensus.status()
        if st.leader is None:
            self._unavailable(
                context, "catching up after start: no leader heard yet; ask another replica"
            )
        self._unavailable(
            context,
            f"catching up after start: {st.lag} committed "
            "entries not applied yet; ask another replica",
        )

    def _barrier(self, context: grpc.ServicerContext) -> None:
        if self.consensus.status().leader is None:
            self._unavailable(context, "no leader: linearizable reads need a quorum")
        res = self.consensus.barrier(self._timeout_s(context, self.limits.barrier_timeout_ms))
        if res.outcome is not Outcome.COMMITTED:
            self._unavailable(context, f"linearizable read barrier failed: {res.reason}")
        self.metrics.barriers.inc()

    # ---------------------------------------------------------------- writes

    @_rpc
    def Publish(
        self, request: pb.PublishRequest, context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        self._authorize(request.node_id, context)
        cmd = validate.publish(request, self.limits)
        self.shards.check(cmd.hashes, context)
        self.metrics.publish_batch.observe(len(cmd.hashes))
        res = self._write(cmd, context)
        assert isinstance(res, Published)
        return pb.PublishResponse(
            applied=res.applied, stale=res.stale, applied_index=self._applied_index()
        )

    @_rpc
    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.RemoveResponse:
        self._authorize(request.node_id, context)
        cmd = validate.remove(request, self.limits)
        self.shards.check(cmd.hashes, context)
        res = self._write(cmd, context)
        assert isinstance(res, Removed)
        return pb.RemoveResponse(removed=res.removed, applied_index=self._applied_index())

    @_rpc
    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNodeResponse:
        self._authorize(request.node_id, context)
        nid, lease_ms = validate.registration(request, self.cfg.lease_default_ms)
        cmd = RegisterNode(
            nid,
            request.host,
            request.agent_endpoint,
            tuple(request.transports),
            request.incarnation,
            lease_ms,
            self.clock.now_ms(),
        )
        res = self._write(cmd, context)
        assert isinstance(res, Registered)
        log.info(
            "node registered",
            extra={
                "node_id": nid,
                "incarnation": request.incarnation,
                "replaced": res.replaced_incarnation,
            },
        )
        return pb.RegisterNodeResponse(
            lease_expiry_ms=res.lease_expiry_ms,
            lease_ms=res.lease_ms,
            replaced_incarnation=res.replaced_incarnation,
        )

    @_rpc
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        self._authorize(request.node_id, context)
        cmd = Heartbeat(validate.node_id(request.node_id), request.incarnation, self.clock.now_ms())
        res = self._write(cmd, context)
        assert isinstance(res, Renewed)
        return pb.HeartbeatResponse(lease_expiry_ms=res.lease_expiry_ms)

    @_rpc
    def ClearNode(
        self, request: pb.ClearNodeRequest, context: grpc.ServicerContext
    ) -> pb.ClearNodeResponse:
        self._authorize(request.node_id, context)
        ns = validate.namespace_key(request.namespace) if request.HasField("namespace") else None
        cmd = ClearNode(
            validate.node_id(request.node_id), request.incarnation, ns, request.deregister
        )
        res = self._write(cmd, context)
        assert isinstance(res, Removed)
        return pb.ClearNodeResponse(removed=res.removed)

    # ----------------------------------------------------------------- reads

    def _applied_index(self) -> int:
        return self.consensus.status().applied_index

    def _fill(self, out: Any, table: Table, matches: list[Match], omit_records: bool) -> None:
        """Append NodeMatch messages to `out` (inside `consensus.read`)."""
        answer.fill(out, table, matches, omit_records)

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        ns, chain, max_nodes = validate.lookup_chain(request, self.limits)
        if not self.shards.view.owns_all:  # else nothing to check: skip making the list
            self.shards.check(chain.items(), context)
        self.metrics.lookup_chain.observe(len(chain))
        if request.linearizable:
            self._barrier(context)
        else:
            self._check_caught_up(context)
        resp = pb.LookupResponse()
        moving: list[str] = []

        def lookup(table: Table) -> None:
            if table.fence and (why := table.fence.lookup_refusal(chain.items())) is not None:
                moving.append(why)
                return
            matches = table.lookup(ns, chain, max_nodes, request.exclude_node)
            self._fill(resp.matches, table, matches, request.omit_records)

        self.consensus.read(lookup)
        if moving:
            self.shards.moving(context, moving[0])
        resp.read.CopyFrom(self.read_info(request.linearizable))
        return resp

    @_rpc
    def LookupBatch(
        self, request: pb.LookupBatchRequest, context: grpc.ServicerContext
    ) -> pb.LookupBatchResponse:
        if len(request.lookups) > self.limits.lookup_batch_max:
            raise validate.BadRequest(
                "too-many-lookups",
                f"{len(request.lookups)} lookups is over the limit of "
                f"{self.limits.lookup_batch_max}",
            )
        parsed = [validate.lookup_chain(lk, self.limits) for lk in request.lookups]
        if not self.shards.view.owns_all:
            for _, chain, _ in parsed:
                self.shards.check(chain.items(), context)
        if request.linearizable:
            self._barrier(context)
        else:
            self._check_caught_up(context)
        resp = pb.LookupBatchResponse()
        moving: list[str] = []

        def lookup_all(table: Table) -> None:
            if table.fence:
                found = (table.fence.lookup_refusal(chain.items()) for _, chain, _ in parsed)
                why = next((w for w in found if w is not None), None)
                if why is not None:
                    moving.append(why)
                    return
            for lk, (ns, chain, max_nodes) in zip(request.lookups, parsed, strict=True):
                matches = table.lookup(ns, chain, max_nodes, lk.exclude_node)
                self._fill(resp.results.add().matches, table, matches, lk.omit_records)

        self.consensus.read(lookup_all)
        if moving:
            self.shards.moving(context, moving[0])
        resp.read.CopyFrom(self.read_info(request.linearizable))
        return resp

    @_rpc
    def ListNodes(
        self, request: pb.ListNodesRequest, context: grpc.ServicerContext
    ) -> pb.ListNodesResponse:
        resp = pb.ListNodesResponse()

        def list_nodes(table: Table) -> None:
            for n in sorted(table.nodes.values(), key=lambda n: n.node_id):
                resp.nodes.add(
                    node_id=n.node_id,
                    host=n.host,
                    agent_endpoint=n.endpoint,
                    transports=n.transports,
                    incarnation=n.incarnation,
                    lease_expiry_ms=n.lease_expiry_ms,
                    entries=n.entries,
                )

        self.consensus.read(list_nodes)
        resp.read.CopyFrom(self.read_info(False))
        return resp

    @_rpc
    def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClusterStatusResponse:
        st = self.consensus.status()
        resp = pb.ClusterStatusResponse(
            replica_id=self.cfg.replica_id,
            role=_ROLE[st.role],
            leader_id=self.label(st.leader)[0] if st.leader else "",
            leader_grpc_address=self.leader_grpc(),
            term=st.term,
            commit_index=st.commit_index,
            applied_index=st.applied_index,
            has_quorum=st.has_quorum,
            log_entries=st.log_entries,
            last_compaction_s=st.last_compaction_s,
            cluster_id=st.cluster_id,
            group_id=self.cfg.group,
            shard_map_version=self.shards.view.version,
        )
        for m in self.consensus.members():
            rid, grpc_addr = self.label(m.address)
            resp.members.add(
                replica_id=rid or m.address,
                raft_address=m.address,
                grpc_address=grpc_addr,
                connected=m.connected,
                is_self=m.is_self,
            )

        def sizes(t: Table) -> None:
            resp.entries, resp.blocks = t.entries, t.block_count
            resp.nodes, resp.namespaces = len(t.nodes), len(t.ns_names)

        self.consensus.read(sizes)
        if request.with_digest:
            resp.applied_index, resp.state_digest = self._digest(context)
        return resp

    def _digest(self, context: grpc.ServicerContext) -> tuple[int, bytes]:
        """(applied index, table digest at it), computed off the Raft thread.

        The digest sorts every entry (tens of seconds at millions): taken inside
        `consensus.read` it held the table while the Raft thread waited to apply,
        and replicas lost their leader. A capture freezes the table between two
        applies (cheap, copy-on-write) and the digest runs over the copy. One at a
        time per replica: each holds a copy of the table."""
        if not self._digest_slot.acquire(timeout=DIGEST_WAIT_S):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "another state digest is being computed on this replica; ask again",
            )
        try:
            try:
                cap = self.consensus.capture(DIGEST_CAPTURE_TIMEOUT_S)
            except TimeoutError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"state digest: {e}")
            image = cap.image
            try:
                return cap.index, snapshot.table_of(image).digest()
            finally:
                snapshot.drop(image)
        finally:
            self._digest_slot.release()

    @_rpc
    def GetShardMap(
        self, request: pb.GetShardMapRequest, context: grpc.ServicerContext
    ) -> pb.GetShardMapResponse:
        return self.shards.get_map(request, context)

    def Watch(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchEvent]:
        if self.watch is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "watch is not ready on this replica yet")
        return self.watch.watch(request, context)


class EchoService(pb_grpc.EchoServicer):
    """The benchmark's baseline: same server and transport, no directory work."""

    RESPONSE_BYTES_MAX = 16 * 1024 * 1024

    def Echo(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoResponse:
        if request.response_bytes > self.RESPONSE_BYTES_MAX:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "response_bytes over 16 MiB")
        return pb.EchoResponse(payload=b"\x00" * request.response_bytes)


class LeaseSweeper:
    """On the leader, propose ExpireNodes for nodes whose lease ran out.

    A new leader counts every lease as renewed when it took over (etcd's
    lessor does the same): its predecessor may have accepted heartbeats it
    never saw applied, and clocks of two replicas differ.
    """

    def __init__(
        self,
        consensus: Consensus,
        clock: Clock,
        interval_ms: int,
        metrics: DirectoryMetrics,
        write_timeout_s: float,
    ) -> None:
        self.consensus = consensus
        self.clock = clock
        self.interval_s = interval_ms / 1000
        self.metrics = metrics
        self.write_timeout_s = write_timeout_s
        self.stop = threading.Event()
        self.leader_since_ms: int | None = None

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception:
                log.exception("lease sweep failed")

    def sweep_once(self) -> None:
        now = self.clock.now_ms()
        if not self.consensus.is_leader():
            self.leader_since_ms = None
            return
        if self.leader_since_ms is None:
            self.leader_since_ms = now
        since = self.leader_since_ms
        expired = self.consensus.read(
            lambda t: t.expired_nodes(now, EXPIRE_NODES_PER_COMMAND_MAX, grace_from_ms=since)
        )
        if not expired:
            return
        res = self.consensus.write(ExpireNodes(now, tuple(expired)), self.write_timeout_s)
        if res.outcome is Outcome.COMMITTED and isinstance(res.result, Expired):
            self.metrics.lease_expiries.inc(len(res.result.nodes))
            if res.result.nodes:
                log.info(
                    "leases expired",
                    extra={"nodes": list(res.result.nodes), "entries_removed": res.result.removed},
                )
