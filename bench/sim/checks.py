"""What the simulator checks after every step (and at the end of a run).

- `leaders`: at most one leader per term, over the whole run.
- `committed`: the committed log is one log. When a replica's commit index
  covers an entry, the entry it holds there must be the one every other
  replica had there when they committed it (term and bytes), and a replica
  must never cut an entry at or below its own commit index, nor cut an
  entry that matches the committed one (Raft truncates only at the first
  conflicting entry); the cut is seen by wrapping the journal's
  `deleteEntriesFrom`.
- `digests`: replicas at the same applied index have the same table digest.
- `applied`: every entry a replica applies (what its apply listeners, and so
  a Watch stream and every mirror, see) is the entry committed at that index.
  An entry applied before any replica was seen committing its index waits in
  `pending` until one is (an entry still pending when the run ends was never
  committed).
- `MirrorChecks`: a mirror's applied index never goes backwards, never passes
  the largest commit index any replica has reached, nor the commit index the
  mirror itself has heard of (what its reads report: issue 29 hole 6); its
  table digest is compared with a replica's at the same index (`digest`).

A violation is a `Violation` (kind, step, detail); the run records it and
goes on, so one seed can show several.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    step: int
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.kind}: {self.detail}"


def fingerprint(entry: tuple[bytes, int, int]) -> tuple[int, int]:
    """(term, CRC-32 of the command): enough to tell two entries at one index apart."""
    return entry[2], zlib.crc32(bytes(entry[0]))


@dataclass
class Invariants:
    report: Callable[[str, str], None]
    leaders: dict[int, str] = field(default_factory=dict)
    committed: dict[int, tuple[int, int]] = field(default_factory=dict)
    digests: dict[int, tuple[bytes, str]] = field(default_factory=dict)
    pending: dict[int, list[tuple[str, tuple[int, int]]]] = field(default_factory=dict)

    def leader(self, address: str, role: int, term: int) -> None:
        if role != _LEADER:
            return
        first = self.leaders.setdefault(term, address)
        if first != address:
            self.report("two_leaders", f"term {term}: {first} and {address}")

    def commit(self, address: str, r: Any, since: int) -> int:
        """Compare entries (since, commit index] of `r` with the committed log; returns
        the commit index checked up to."""
        commit = int(r.raftCommitIndex)
        last = r.last_log_index()
        for idx in range(since + 1, min(commit, last) + 1):
            entry = r.entry_at(idx)
            if entry is None:
                continue  # compacted into a snapshot before we looked
            fp = fingerprint(entry)
            known = self.committed.setdefault(idx, fp)
            for applier, applied in self.pending.pop(idx, []):
                self._applied_check(applier, idx, applied, known)
            if known != fp:
                self.report(
                    "committed_entry_differs",
                    f"{address} index {idx}: term {fp[0]} where term {known[0]} was committed",
                )
        return max(since, commit)

    def cut(self, address: str, r: Any, from_index: int) -> None:
        """Called before `r`'s journal cuts its log from `from_index` on."""
        commit = int(r.raftCommitIndex)
        if from_index <= commit:
            self.report(
                "cut_committed", f"{address} cuts from {from_index}, its commit index is {commit}"
            )
        entry = r.entry_at(from_index)
        if entry is not None and self.committed.get(from_index) == fingerprint(entry):
            self.report(
                "cut_matching",
                f"{address} cuts from {from_index}, an entry matching the committed one "
                f"(term {entry[2]}; commit index {commit})",
            )

    def applied(self, address: str, index: int, entry: tuple[bytes, int, int] | None) -> None:
        """Called as `address` applies the entry at `index` (before anything sees it)."""
        if entry is None:
            return
        fp = fingerprint(entry)
        known = self.committed.get(index)
        if known is None:
            self.pending.setdefault(index, []).append((address, fp))
        else:
            self._applied_check(address, index, fp, known)

    def _applied_check(
        self, address: str, index: int, applied: tuple[int, int], committed: tuple[int, int]
    ) -> None:
        if applied != committed:
            self.report(
                "applied_uncommitted",
                f"{address} applied index {index} term {applied[0]}; "
                f"term {committed[0]} was committed there",
            )

    def never_committed(self) -> None:
        """At the end: entries applied at an index no replica ever committed."""
        for index, appliers in sorted(self.pending.items()):
            for address, fp in appliers:
                self.report(
                    "applied_uncommitted",
                    f"{address} applied index {index} term {fp[0]}, never committed",
                )
        self.pending = {}

    def digest(self, address: str, applied: int, digest: bytes) -> None:
        known = self.digests.setdefault(applied, (digest, address))
        if known[0] != digest:
            self.report(
                "digest_differs",
                f"index {applied}: {address} {digest.hex()[:12]} vs {known[1]} "
                f"{known[0].hex()[:12]}",
            )


@dataclass
class MirrorChecks:
    """A mirror's position after every step (see the module docstring)."""

    report: Callable[[str, str], None]
    applied: int = 0
    last: tuple[int, int, int] = (0, 0, 0)
    """The position checked last (one that stays wrong is reported once)."""

    def position(self, applied: int, heard_commit: int, max_commit: int) -> None:
        """`applied`, `heard_commit`: the mirror's; `max_commit`: the largest commit
        index any replica has reached so far in the run."""
        if (applied, heard_commit, max_commit) == self.last:
            return
        self.last = (applied, heard_commit, max_commit)
        if applied < self.applied:
            self.report("mirror_backwards", f"mirror applied index {applied} after {self.applied}")
        if applied > max_commit:
            self.report(
                "mirror_ahead",
                f"mirror applied index {applied}; no replica has committed past {max_commit}",
            )
        if applied > heard_commit:
            self.report(
                "mirror_ahead_of_heard",
                f"mirror applied index {applied} past the commit index it heard, {heard_commit}",
            )
        self.applied = max(self.applied, applied)


def check_seat(
    inv: Invariants, addr: str, seat: Any, sample: bool, note: Callable[[str], None]
) -> None:
    """One running replica's share of a step's checks (a `replicas.SimReplica` seat):
    one leader per term, its committed entries, and, when `sample`, its table digest.
    Says a change of role or term in the trace."""
    r = seat.replica
    role, term = r.role(), int(r.raftCurrentTerm)
    inv.leader(addr, role, term)
    if (role, term) != seat.seen_role:
        seat.seen_role = (role, term)
        name = ("follower", "candidate", "leader")[role]
        note(f"{addr} {name} in term {term} (commit {int(r.raftCommitIndex)})")
    seat.checked_commit = inv.commit(addr, r, seat.checked_commit)
    applied = int(r.raftLastApplied)
    if sample and applied != seat.seen_applied:
        seat.seen_applied = applied
        inv.digest(addr, applied, r.table.digest())


def watch_cuts(r: Any, on_cut: Callable[[int], None]) -> None:
    """Route `r`'s journal cuts (`deleteEntriesFrom(position)`) through `on_cut(index)` first."""
    journal = r.kvdir_journal
    original = journal.deleteEntriesFrom

    def delete_from(pos: int) -> None:
        entries = journal.log.entries
        if pos < len(entries):
            on_cut(int(entries[pos][1]))
        original(pos)

    journal.deleteEntriesFrom = delete_from


__all__ = [
    "Invariants",
    "MirrorChecks",
    "Violation",
    "check_seat",
    "fingerprint",
    "watch_cuts",
]
