"""The consensus port in one process: N replicas of the table, one shared log.

No sockets, no threads, no clock: a proposal commits at once (the cluster
appends it to its log and every replica that is not held back applies it,
in index order), and time enters only through the commands the server
stamps with its injected clock. Unit tests and the seeded simulation drive
the server's real logic with it; they steer Raft's side explicitly:

- `elect(address)` / `elect(None)`: a new leader (new term) or none at all;
- `hold(address)` / `release(address, upto)`: a replica that stops applying
  (a slow follower, a restart replaying its journal) and catches up later;
- `fail_next(outcome, reason, applied)`: the next proposal reports this
  outcome; with `applied=True` it commits anyway (an "unknown" that did).
- `replica.install_snapshot()`: a replica catches up as if a snapshot came.

A wait that cannot end here never sleeps: a write whose replica is held
reports UNKNOWN at once (nothing else could release it while we wait).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvdir.directory import snapshot
from kvdir.directory.commands import Barrier, Command
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
from kvdir.directory.table import Table

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Fault:
    outcome: Outcome
    reason: str
    applied: bool


class MemoryCluster:
    """Replicas addressed by name; the first one leads (term 1) until told otherwise."""

    def __init__(self, addresses: Sequence[str] = ("mem-1:1",), cluster_id: str = "") -> None:
        if not addresses:
            raise ValueError("a cluster needs at least one replica")
        self.lock = threading.RLock()
        self.cluster_id = cluster_id
        self.term = 1
        self.log: list[tuple[int, Command]] = []
        """Committed entries as (term, command); entry i has index i + 1."""
        self.leader: str | None = addresses[0]
        self.replicas: dict[str, MemoryReplica] = {a: MemoryReplica(self, a) for a in addresses}
        self._faults: list[_Fault] = []

    def __getitem__(self, address: str) -> MemoryReplica:
        return self.replicas[address]

    def elect(self, address: str | None) -> None:
        with self.lock:
            if address is not None and address not in self.replicas:
                raise KeyError(f"{address} is not a member")
            self.leader = address
            self.term += 1

    def hold(self, address: str) -> None:
        self.replicas[address].held = True

    def release(self, address: str, upto: int | None = None) -> None:
        """Let `address` apply up to `upto` (everything when None); held again if short of it."""
        r = self.replicas[address]
        r.held = False
        r.catch_up(upto)
        if upto is not None and upto < len(self.log):
            r.held = True

    def fail_next(self, outcome: Outcome, reason: str, applied: bool = False) -> None:
        self._faults.append(_Fault(outcome, reason, applied))

    def commit(self, cmd: Command) -> int:
        """Append `cmd` to the log; every replica not held applies it. Returns its index."""
        with self.lock:
            self.log.append((self.term, cmd))
            for r in self.replicas.values():
                r.catch_up(None)
            return len(self.log)

    def take_fault(self) -> _Fault | None:
        with self.lock:
            return self._faults.pop(0) if self._faults else None


class MemoryReplica(Consensus):
    """One member of a `MemoryCluster` (see the module docstring)."""

    def __init__(self, cluster: MemoryCluster, address: str) -> None:
        self.cluster = cluster
        self.address = address
        self.lock = threading.Lock()
        self.table = Table()
        self.applied = 0
        self.held = False
        self.closed = False
        self.labels = ("", "")
        self._pending: dict[int, Done] = {}
        self._listeners: list[ApplyListener] = []
        self._installs: list[InstallListener] = []

    # ---------------------------------------------------------------- applying

    def catch_up(self, upto: int | None) -> None:
        c = self.cluster
        with c.lock:
            end = len(c.log) if upto is None else min(upto, len(c.log))
            while not self.held and self.applied < end:
                self._apply(self.applied + 1, c.log[self.applied][1])

    def _apply(self, index: int, cmd: Command) -> None:
        with self.lock:
            result = self.table.apply(cmd)
        for fn in self._listeners:  # before `applied` counts it, as the port says
            fn(index, cmd, result)
        self.applied = index
        done = self._pending.pop(index, None)
        if done is not None:
            done(WriteResult(Outcome.COMMITTED, result))

    # ------------------------------------------------------------------ verbs

    def propose(self, cmd: Command, on_done: Done) -> None:
        c = self.cluster
        with c.lock:
            if c.leader is None:
                on_done(WriteResult(Outcome.NOT_APPLIED, None, "no leader (memory cluster)"))
                return
            fault = c.take_fault()
            if fault is not None:
                if fault.applied:
                    c.commit(cmd)
                on_done(WriteResult(fault.outcome, None, fault.reason))
                return
            self._pending[len(c.log) + 1] = on_done
            c.commit(cmd)

    def write(self, cmd: Command, timeout_s: float) -> WriteResult:
        box: list[WriteResult] = []
        self.propose(cmd, box.append)
        if not box:
            return WriteResult(Outcome.UNKNOWN, None, f"no outcome within {timeout_s:.3f}s")
        return box[0]

    def barrier(self, timeout_s: float) -> WriteResult:
        res = self.write(Barrier(), timeout_s)
        if res.outcome is Outcome.UNKNOWN:
            return WriteResult(Outcome.UNKNOWN, None, f"no barrier within {timeout_s:.3f}s")
        return res

    def read(self, fn: Callable[[Table], T]) -> T:
        with self.lock:
            return fn(self.table)

    # status() and members() take no lock (reads of plain attributes), so they
    # may be called inside `read`, as the pysyncobj adapter allows too.

    def status(self) -> Status:
        c = self.cluster
        leader = c.leader
        return Status(
            role=Role.LEADER if leader == self.address else Role.FOLLOWER,
            term=c.term,
            leader=leader,
            commit_index=len(c.log),
            applied_index=self.applied,
            has_quorum=leader is not None,
            log_entries=len(c.log),
            cluster_id=c.cluster_id,
        )

    def members(self) -> list[Member]:
        out = [Member(self.address, True, True)]
        for addr, r in sorted(list(self.cluster.replicas.items())):
            if addr != self.address:
                out.append(Member(addr, True, False, *r.labels))
        return out

    def add_member(self, member: Member, on_done: Done) -> None:
        c = self.cluster
        with c.lock:
            if c.leader != self.address:
                on_done(WriteResult(Outcome.NOT_APPLIED, None, "not the leader"))
                return
            added = c.replicas[member.address] = MemoryReplica(c, member.address)
            added.labels = (member.replica_id, member.grpc_address)
            added.catch_up(None)
        on_done(WriteResult(Outcome.COMMITTED))

    def remove_member(self, address: str, on_done: Done) -> None:
        c = self.cluster
        with c.lock:
            if c.leader != self.address or address == self.address:
                on_done(WriteResult(Outcome.NOT_APPLIED, None, "refused", refused=True))
                return
            c.replicas.pop(address, None)
        on_done(WriteResult(Outcome.COMMITTED))

    def transfer_leadership(self) -> None:
        c = self.cluster
        with c.lock:
            if c.leader != self.address:
                return
            others = sorted(a for a, r in c.replicas.items() if a != self.address and not r.held)
            if others:
                c.elect(others[0])

    def capture(self, timeout_s: float) -> Capture:
        c = self.cluster
        with c.lock, self.lock:
            frozen = snapshot.freeze(self.table)
            term = c.log[self.applied - 1][0] if self.applied else 0
            return Capture(frozen, self.applied, term, self.member_addresses())

    def add_apply_listener(
        self, fn: ApplyListener, on_install: InstallListener | None = None
    ) -> int:
        with self.cluster.lock:  # no apply runs meanwhile
            self._listeners.append(fn)
            if on_install is not None:
                self._installs.append(on_install)
            return self.applied

    def install_snapshot(self) -> None:
        """Catch up as a snapshot install would: the table jumps to the commit
        index without its commands passing the apply listeners."""
        c = self.cluster
        with c.lock:
            table = Table()
            for _, cmd in c.log:
                table.apply(cmd)
            with self.lock:
                self.table = table
            index = len(c.log)
            for fn in self._installs:
                fn(index)
            self.applied = index

    def close(self) -> None:
        self.closed = True


__all__ = ["MemoryCluster", "MemoryReplica"]
