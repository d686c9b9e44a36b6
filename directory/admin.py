"""kvdir.v1.DirectoryAdmin: membership changes and backups, for operators.

Membership changes are Raft's (a log entry that takes effect on every
member as it is appended). The leader proposes them, one at a time; this
service adds the checks the consensus port leaves to the caller:

- only on the leader (FAILED_PRECONDITION naming the leader elsewhere);
- the address is well formed (INVALID_ARGUMENT), a new member is not one
  already (ALREADY_EXISTS), a removed one is one (NOT_FOUND);
- the change keeps a quorum of members this leader can reach: adding a
  member that is not running yet raises the quorum, and removing a live
  member while others are down can leave too few (FAILED_PRECONDITION).
  A single-member cluster may still add one: growing 1 -> 2 always pauses
  writes until the new member has caught up;
- the leader does not remove itself (Raft refuses); it hands leadership
  to a caught-up follower instead and says to retry there.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from kvdir.core.security import authorize_admin
from kvdir.directory import backup, shard_admin
from kvdir.directory.config import DirectoryConfig
from kvdir.directory.consensus.membership import MembershipError, parse_raft_address
from kvdir.directory.consensus.port import Consensus, Done, Member, Outcome, WriteResult
from kvdir.directory.shard_view import ShardView
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.directory.admin")

_REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHANGE_TIMEOUT_S = 10.0
CAPTURE_TIMEOUT_S = 10.0


def quorum_ok(reachable: int, members: int) -> bool:
    """Whether `reachable` of `members` (the leader counted in both) is a majority."""
    return members > 0 and reachable * 2 > members


class AdminService(pb_grpc.DirectoryAdminServicer):
    def __init__(
        self,
        cfg: DirectoryConfig,
        consensus: Consensus,
        leader_grpc: Callable[[], str],
        label: Callable[[str], tuple[str, str]],
        cluster_id: str,
        shard_view: ShardView | None = None,
    ) -> None:
        self.cfg = cfg
        self.shard_view = shard_view or ShardView(cfg.group, sharded=False)
        self.consensus = consensus
        self.leader_grpc = leader_grpc
        self.label = label
        self.cluster_id = cluster_id
        self._change_lock = threading.Lock()
        self._backup_slot = threading.BoundedSemaphore(1)

    # --------------------------------------------------------------- helpers

    def _abort(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        context.set_trailing_metadata((("kvdir-leader", self.leader_grpc()),))
        context.abort(code, message)

    def _address(self, raw: str, context: grpc.ServicerContext) -> str:
        try:
            return parse_raft_address(raw)
        except MembershipError as e:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _require_leader(self, context: grpc.ServicerContext) -> None:
        if not self.consensus.is_leader():
            hint = self.leader_grpc()
            where = f"the leader is at {hint}" if hint else "no leader is known right now"
            self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"membership changes run on the leader; {where}",
            )

    def _self_address(self) -> str:
        return next(m.address for m in self.consensus.members() if m.is_self)

    def _reachable(self, members: list[str]) -> int:
        """Members this leader is connected to, itself included."""
        connected = {m.address for m in self.consensus.members() if m.connected and not m.is_self}
        return 1 + sum(1 for m in members if m in connected)

    def _response(self) -> pb.MembershipResponse:
        c = self.consensus
        resp = pb.MembershipResponse(applied_index=c.status().applied_index)
        for m in c.members():
            rid, grpc_addr = self.label(m.address)
            resp.members.add(
                replica_id=rid,
                raft_address=m.address,
                grpc_address=grpc_addr,
                connected=m.connected,
                is_self=m.is_self,
            )
        return resp

    def _change(
        self,
        propose: Callable[[Done], None],
        what: str,
        context: grpc.ServicerContext,
    ) -> pb.MembershipResponse:
        done = threading.Event()
        box: list[WriteResult] = []

        def on_done(res: WriteResult) -> None:
            box.append(res)
            done.set()

        propose(on_done)
        remaining = context.time_remaining()
        wait_s = CHANGE_TIMEOUT_S if remaining is None else min(CHANGE_TIMEOUT_S, remaining)
        if not done.wait(max(0.0, wait_s)):
            context.set_trailing_metadata((("kvdir-outcome", "unknown"),))
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{what}: not committed within {wait_s:.1f}s; check `kvdir ctl status`",
            )
        res = box[0]
        if res.outcome is Outcome.COMMITTED:
            log.info("membership changed", extra={"change": what})
            return self._response()
        if res.refused:
            self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what}: refused by raft (a previous membership change or the new "
                "leader's first entry is not committed yet); retry in a moment",
            )
        if res.outcome is Outcome.UNKNOWN:
            context.set_trailing_metadata((("kvdir-outcome", "unknown"),))
            context.abort(
                grpc.StatusCode.ABORTED,
                f"{what}: outcome unknown (leader changed); check `kvdir ctl status`",
            )
        self._abort(context, grpc.StatusCode.UNAVAILABLE, f"{what}: not applied ({res.reason})")

    # ------------------------------------------------------------ membership

    def AddReplica(
        self, request: pb.AddReplicaRequest, context: grpc.ServicerContext
    ) -> pb.MembershipResponse:
        authorize_admin(context, self.cfg.auth.admins, "add replicas")
        addr = self._address(request.raft_address, context)
        grpc_addr = self._address(request.grpc_address, context) if request.grpc_address else ""
        if request.replica_id and not _REPLICA_ID_RE.match(request.replica_id):
            self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica id {request.replica_id!r} must be 1-64 of [A-Za-z0-9_.-]",
            )
        member = Member(addr, False, False, request.replica_id, grpc_addr)
        self._require_leader(context)
        with self._change_lock:
            members = self.consensus.member_addresses()
            if addr in members:
                self._abort(context, grpc.StatusCode.ALREADY_EXISTS, f"{addr} is already a member")
            # The new member counts toward the quorum at once but is not caught up yet.
            # A lone member cannot grow without that pause (2 of 2), so it may.
            if len(members) > 1 and not quorum_ok(self._reachable(members), len(members) + 1):
                self._abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"adding {addr} would leave no quorum: {self._reachable(members)} of "
                    f"{len(members)} members are reachable; bring members back first",
                )
            return self._change(
                lambda cb: self.consensus.add_member(member, cb),
                f"add {addr}",
                context,
            )

    def RemoveReplica(
        self, request: pb.RemoveReplicaRequest, context: grpc.ServicerContext
    ) -> pb.MembershipResponse:
        authorize_admin(context, self.cfg.auth.admins, "remove replicas")
        addr = self._address(request.raft_address, context)
        self._require_leader(context)
        with self._change_lock:
            members = self.consensus.member_addresses()
            if addr not in members:
                self._abort(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"{addr} is not a member (members: {', '.join(members)})",
                )
            if addr == self._self_address():
                self.consensus.transfer_leadership()
                self._abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{addr} is the leader and cannot remove itself; leadership is being "
                    "handed to a follower, retry there",
                )
            rest = [m for m in members if m != addr]
            if not quorum_ok(self._reachable(rest), len(rest)):
                self._abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"removing {addr} would leave no quorum: {self._reachable(rest)} of the "
                    f"{len(rest)} remaining members are reachable",
                )
            return self._change(
                lambda cb: self.consensus.remove_member(addr, cb),
                f"remove {addr}",
                context,
            )

    # ---------------------------------------------------------------- shards

    def SetShardMap(
        self, request: pb.SetShardMapRequest, context: grpc.ServicerContext
    ) -> pb.SetShardMapResponse:
        authorize_admin(context, self.cfg.auth.admins, "change the shard map")
        return shard_admin.set_shard_map(self.shard_view, self.consensus, request, context)

    def MoveShard(
        self, request: pb.MoveShardRequest, context: grpc.ServicerContext
    ) -> pb.MoveShardResponse:
        authorize_admin(context, self.cfg.auth.admins, "move shards")
        return shard_admin.move_shard(self.consensus, request, context)

    def ImportShard(
        self, request: pb.ImportShardRequest, context: grpc.ServicerContext
    ) -> pb.ImportShardResponse:
        authorize_admin(context, self.cfg.auth.admins, "import shards")
        return shard_admin.import_shard(self.consensus, request, context)

    # ---------------------------------------------------------------- backup

    def Backup(
        self, request: pb.BackupRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BackupChunk]:
        authorize_admin(context, self.cfg.auth.admins, "take backups")
        if not self._backup_slot.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "a backup is already running here")
        try:
            if not request.skip_barrier:
                res = self.consensus.barrier(CAPTURE_TIMEOUT_S)
                if res.outcome is not Outcome.COMMITTED:
                    self._abort(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        f"backup barrier failed ({res.reason}); with no quorum, "
                        "back up with --skip-barrier or use `kvdir directory recover`",
                    )
            try:
                cap = self.consensus.capture(CAPTURE_TIMEOUT_S)
            except TimeoutError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            image, index, term, members = cap.image, cap.index, cap.term, cap.members
            # Staged in the data dir: writable wherever the replica runs, and on disk.
            body = backup.snapshot_bytes(image, members, index, self.cfg.data_dir)
            header = backup.make_header(
                body,
                kind="backup",
                source_replica=self.cfg.replica_id,
                source_cluster_id=self.cluster_id,
                term=term,
                index=index,
                entries=int(image.meta["entries"]),
                members=members,
            )
            log.info("backup taken", extra={"index": index, "entries": header.entries})
            for chunk in backup.encode(header, body):
                yield pb.BackupChunk(data=chunk)
        finally:
            self._backup_slot.release()
