"""The consensus port: what the directory needs from Raft, and nothing else.

The server, the daemon, the admin service and backups speak only this
module's types; `syncobj.RaftConsensus` implements it over
pysyncobj, `memory.MemoryCluster` in one process for tests and simulation.

Verbs of `Consensus` (every other method is built on them):

- `propose(cmd, on_done)`: replicate one command; `on_done(WriteResult)` runs
  once, on the consensus thread, after *this* replica applied it (or once the
  outcome is known not to be "committed"). `write` waits for it.
- `barrier(timeout_s)`: a linearizable read's fence: once it returns
  COMMITTED, everything committed before the call has been applied here.
- `read(fn)`: run `fn(table)` under the apply lock, so it sees a whole
  command or none of it.
- `status()`: a `Status` value (role, term, leader, indexes, quorum, ...).
- `members()`: every member as a `Member` value (self included).
- `add_member` / `remove_member`: a membership change, outcome by callback.
- `transfer_leadership()`: ask the leader to hand over to a caught-up follower.
- `capture(timeout_s)`: a `Capture` of the table taken between two applies,
  with the applied index and term it reflects. Taking it costs the consensus
  thread O(nodes); its `image` is copied on first use, on the caller's thread.
- `add_apply_listener(fn, on_install)`: `fn(index, command, result)` runs on
  the consensus thread after each command is applied, in index order, holding
  no lock, before `status().applied_index` counts it. Indexes have gaps: Raft's
  own entries (a new leader's no-op, membership changes) carry no command.
  `on_install(index)` runs there when a snapshot replaced the table (it now
  reflects every entry up to `index`), before any later command's `fn`.
  Returns the applied index from which on `fn` sees every command (the ones
  up to it were applied before `fn` was registered).
- `close()`.

Outcomes: COMMITTED (applied here), NOT_APPLIED (definitely not: safe to
retry), UNKNOWN (may or may not have committed: the leader changed, or the
wait timed out). Raised errors: `LogError` for an unreadable on-disk log, and
TimeoutError from `capture` when the consensus thread is stuck.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TypeVar

from kvdir.directory import snapshot
from kvdir.directory.commands import Command, Result
from kvdir.directory.table import Table

T = TypeVar("T")


class Role(IntEnum):
    """A replica's Raft role (the numbering is the role metric's)."""

    FOLLOWER = 0
    CANDIDATE = 1
    LEADER = 2


class Outcome(Enum):
    COMMITTED = "committed"
    NOT_APPLIED = "not_applied"
    """Definitely not applied: safe to retry."""
    UNKNOWN = "unknown"
    """May or may not have committed (leader changed, or the wait timed out)."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    outcome: Outcome
    result: Result | None = None
    reason: str = ""
    refused: bool = False
    """NOT_APPLIED because Raft refused the request itself (a membership change
    while another is pending, or before the new leader's first entry commits)."""


@dataclass(frozen=True, slots=True)
class Status:
    role: Role
    term: int
    leader: str | None
    """The leader's Raft address, None when this replica cannot reach one."""
    commit_index: int
    applied_index: int
    has_quorum: bool
    log_entries: int
    cluster_id: str = ""
    last_compaction_s: float = 0.0

    @property
    def lag(self) -> int:
        """Committed entries not applied here yet."""
        return self.commit_index - self.applied_index


@dataclass(frozen=True, slots=True)
class Member:
    address: str
    """Raft address, HOST:PORT."""
    connected: bool
    is_self: bool
    replica_id: str = ""
    grpc_address: str = ""
    """Labels recorded when the member was added at run time ("" when none)."""


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Capture:
    frozen: snapshot.Frozen
    index: int
    """The applied index the image reflects (every entry up to it, none after)."""
    term: int
    members: list[str]

    @property
    def image(self) -> snapshot.Image:
        """The captured table, copied on first use (never call it on the consensus thread)."""
        return self.frozen.image()


ApplyListener = Callable[[int, Command, Result], None]
InstallListener = Callable[[int], None]
Done = Callable[[WriteResult], None]


class LogError(ValueError):
    """An on-disk Raft log that cannot be read as kvdir's; says why."""


class Consensus(ABC):
    """One replica of the replicated table (see the module docstring)."""

    @abstractmethod
    def propose(self, cmd: Command, on_done: Done) -> None: ...

    @abstractmethod
    def barrier(self, timeout_s: float) -> WriteResult: ...

    @abstractmethod
    def read(self, fn: Callable[[Table], T]) -> T: ...

    @abstractmethod
    def status(self) -> Status: ...

    @abstractmethod
    def members(self) -> list[Member]: ...

    @abstractmethod
    def add_member(self, member: Member, on_done: Done) -> None: ...

    @abstractmethod
    def remove_member(self, address: str, on_done: Done) -> None: ...

    @abstractmethod
    def transfer_leadership(self) -> None: ...

    @abstractmethod
    def capture(self, timeout_s: float) -> Capture: ...

    @abstractmethod
    def add_apply_listener(
        self, fn: ApplyListener, on_install: InstallListener | None = None
    ) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    # ------------------------------------------------------------- built on those

    def write(self, cmd: Command, timeout_s: float) -> WriteResult:
        """Propose `cmd` and wait up to `timeout_s` for its outcome."""
        return wait_outcome(lambda done: self.propose(cmd, done), timeout_s)

    def is_leader(self) -> bool:
        return self.status().role is Role.LEADER

    def member_addresses(self) -> list[str]:
        """The Raft addresses of the current membership (self included), sorted."""
        return sorted(m.address for m in self.members())


def wait_outcome(start: Callable[[Done], None], timeout_s: float) -> WriteResult:
    """Call `start(done)` and wait up to `timeout_s` for `done` (UNKNOWN when it never comes)."""
    finished = threading.Event()
    box: list[WriteResult] = []

    def done(res: WriteResult) -> None:
        box.append(res)
        finished.set()

    start(done)
    if not finished.wait(timeout_s):
        return WriteResult(Outcome.UNKNOWN, None, f"no outcome within {timeout_s:.3f}s")
    return box[0]
