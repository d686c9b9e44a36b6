"""`RaftConsensus`: the consensus port over pysyncobj, which it *holds*.

The adapter owns a private `_replica.Replica` (a SyncObj subclass carrying
kvdir's safety fixes and snapshot hooks) and translates in this one place:
pysyncobj's FAIL_REASON codes into `Outcome`s, its nodes into `Member`s, its
attributes into a `Status`, its tick callbacks into a `capture` taken between
two applies.

Ordering contracts:
- A write's outcome is reported only after this replica applied it.
- A linearizable read first commits a Barrier that was proposed *after* the
  read arrived; everything committed before the read began is then applied.
  Reads that arrive while a barrier is in flight share the next one, so a
  burst of reads costs two Raft round trips, not one each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pysyncobj import FAIL_REASON
from pysyncobj.node import TCPNode

from kvdir.directory import codec, snapshot
from kvdir.directory.commands import Barrier, Command
from kvdir.directory.consensus._replica import Replica, node_labels
from kvdir.directory.consensus.port import (
    ApplyListener,
    Capture,
    Consensus,
    Done,
    InstallListener,
    Member,
    Outcome,
    Role,
    Status,
    WriteResult,
)
from kvdir.directory.consensus.sync import Durability
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.table import Table

T = TypeVar("T")

_NOT_APPLIED = {
    FAIL_REASON.QUEUE_FULL: "raft command queue is full",
    FAIL_REASON.MISSING_LEADER: "no leader (election in progress or no quorum)",
    FAIL_REASON.DISCARDED: "discarded: a new leader overwrote the entry",
    FAIL_REASON.NOT_LEADER: "not the leader (or no longer the leader of the write's term)",
    FAIL_REASON.REQUEST_DENIED: "request denied by raft",
}
_UNKNOWN = {
    FAIL_REASON.LEADER_CHANGED: "leader changed before the commit was confirmed",
    FAIL_REASON.UNKNOWN_OUTCOME: "raft reported an unknown outcome",
}


def result_of(result: Any, error: int) -> WriteResult:
    """The port's value for one pysyncobj callback `(result, FAIL_REASON)`."""
    if error == FAIL_REASON.SUCCESS:
        return WriteResult(Outcome.COMMITTED, result)
    if error in _NOT_APPLIED:
        refused = error == FAIL_REASON.REQUEST_DENIED
        return WriteResult(Outcome.NOT_APPLIED, None, _NOT_APPLIED[error], refused)
    return WriteResult(Outcome.UNKNOWN, None, _UNKNOWN.get(error, f"raft error {error}"))


def _callback(on_done: Done) -> Callable[[Any, int], None]:
    return lambda result, error: on_done(result_of(result, error))


@dataclass(slots=True)
class _Round:
    """One barrier serving every linearizable read that joined it."""

    done: threading.Event = field(default_factory=threading.Event)
    outcome: WriteResult | None = None


class RaftConsensus(Consensus):
    """One directory replica replicated by pysyncobj over TCP (see the module docstring)."""

    def __init__(
        self,
        self_address: str,
        peer_addresses: list[str],
        data_dir: str,
        tuning: RaftTuning | None = None,
        on_role_changed: Callable[[Role, Role], None] | None = None,
        cluster_id: str = "",
        join: bool = False,
        password: str | None = None,
        bind_address: str | None = None,
        durability: Durability = Durability.POWER_LOSS,
    ) -> None:
        """`password` encrypts and authenticates every Raft message (pysyncobj's
        Fernet, which needs `cryptography`); `bind_address` keeps the Raft port
        on the cluster network (pysyncobj's default binds every interface);
        `durability`: what an acknowledged write survives (`durable`).
        Raises OSError when the data dir cannot be used, JournalCorrupt or
        TermFileCorrupt when its Raft files are damaged."""

        def state_changed(old: int, new: int) -> None:
            if on_role_changed is not None:
                on_role_changed(Role(old), Role(new))

        self._cluster_id = cluster_id
        self._barrier_lock = threading.Lock()
        self._barrier_inflight: _Round | None = None
        self._barrier_next: _Round | None = None
        self._r = Replica(
            self_address,
            peer_addresses,
            data_dir,
            tuning or RaftTuning(),
            state_changed,
            cluster_id,
            join,
            password,
            bind_address or self_address,
            durability,
        )

    # ------------------------------------------------------------- lifecycle

    def wait_bound(self) -> None:
        """Return once the Raft port is bound; raise (having closed) when it cannot be."""
        try:
            self._r.waitBinded()
        except Exception as e:
            self._r.destroy()
            raise OSError(f"cannot bind the raft port: {e}") from e

    def close(self) -> None:
        self._r.destroy()

    # ---------------------------------------------------------------- writes

    def propose(self, cmd: Command, on_done: Done) -> None:
        self._r.propose_blob(
            codec.encode(cmd), _callback(on_done), may_forward=isinstance(cmd, Barrier)
        )

    def barrier(self, timeout_s: float) -> WriteResult:
        with self._barrier_lock:
            if self._barrier_inflight is None:
                rnd = self._barrier_inflight = _Round()
                start = True
            else:
                if self._barrier_next is None:
                    self._barrier_next = _Round()
                rnd, start = self._barrier_next, False
        if start:
            self._start_round(rnd)
        if not rnd.done.wait(timeout_s) or rnd.outcome is None:
            return WriteResult(Outcome.UNKNOWN, None, f"no barrier within {timeout_s:.3f}s")
        return rnd.outcome

    def _start_round(self, rnd: _Round) -> None:
        def finished(res: WriteResult) -> None:
            rnd.outcome = res
            rnd.done.set()
            with self._barrier_lock:
                nxt, self._barrier_next = self._barrier_next, None
                self._barrier_inflight = nxt
            if nxt is not None:
                self._start_round(nxt)

        self.propose(Barrier(), finished)

    # ----------------------------------------------------------------- reads

    def read(self, fn: Callable[[Table], T]) -> T:
        r = self._r
        with r.lock:
            return fn(r.table)

    def status(self) -> Status:
        r = self._r
        return Status(
            role=Role(r.role()),
            term=int(r.raftCurrentTerm),
            leader=self._leader(),
            commit_index=int(r.raftCommitIndex),
            applied_index=int(r.raftLastApplied),
            has_quorum=bool(r.hasQuorum),
            log_entries=int(r._getRaftLogSize()),
            cluster_id=self._cluster_id,
            last_compaction_s=r.last_compaction_s,
        )

    def _leader(self) -> str | None:
        """The leader's Raft address, or None when this replica cannot reach one.

        pysyncobj forgets a dead leader only when an election starts, and it
        starts one only while connected to some peer; a follower cut off from
        everyone would otherwise keep naming its dead leader forever.
        """
        r = self._r
        leader = r._getLeader()
        if leader is None or (leader != r.selfNode and not r.isNodeConnected(leader)):
            return None
        return str(leader.address)

    def members(self) -> list[Member]:
        """Self first, then the others by address. Labels travel inside pysyncobj's
        membership entry (TCPNode keeps keyword attributes) and in our snapshots,
        so members added at run time are named on every replica."""
        r = self._r
        out = [Member(str(r.selfNode.address), True, True)]
        for node in sorted(r.otherNodes, key=lambda n: str(n.address)):
            rid, grpc_addr = node_labels(node)
            out.append(
                Member(str(node.address), bool(r.isNodeConnected(node)), False, rid, grpc_addr)
            )
        return out

    # ------------------------------------------------------------ membership

    def add_member(self, member: Member, on_done: Done) -> None:
        labels = {"kvdir_id": member.replica_id, "kvdir_grpc": member.grpc_address}
        node = TCPNode(member.address, **{k: v for k, v in labels.items() if v})
        self._r.addNodeToCluster(node, callback=_callback(on_done))

    def remove_member(self, address: str, on_done: Done) -> None:
        self._r.removeNodeFromCluster(address, callback=_callback(on_done))

    def transfer_leadership(self) -> None:
        self._r.transferLeadership()

    # ------------------------------------------------------------- snapshots

    def capture(self, timeout_s: float) -> Capture:
        """Taken on the Raft thread between applies: on any other thread the applied
        index may trail the table by an entry (pysyncobj bumps it after the apply
        returns); a tick callback runs where neither moves."""
        r = self._r
        box: list[Capture] = []
        done = threading.Event()

        def on_tick() -> None:
            if done.is_set():
                return
            idx = int(r.raftLastApplied)
            entry = r.entry_at(idx)
            with r.lock:
                frozen = snapshot.freeze(r.table)
            box.append(Capture(frozen, idx, entry[2] if entry else 0, self.member_addresses()))
            done.set()

        r.addOnTickCallback(on_tick)
        try:
            if not done.wait(timeout_s):
                raise TimeoutError(f"the raft thread took no snapshot within {timeout_s:.1f}s")
        finally:
            r.removeOnTickCallback(on_tick)
        return box[0]

    def add_apply_listener(
        self, fn: ApplyListener, on_install: InstallListener | None = None
    ) -> int:
        return self._r.add_listener(fn, on_install)

    @property
    def compactions(self) -> int:
        """Log compactions this replica finished since it started."""
        return self._r.compactions


__all__ = ["RaftConsensus", "result_of"]
