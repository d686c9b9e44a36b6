"""Safety fixes to pysyncobj's follower, as pure functions of the log (no I/O, no clock).

`_replica.Replica` calls them from its overrides of pysyncobj's handlers;
they are here, apart, so unit tests can drive them with plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RaftEntry = tuple[bytes, int, int]
"""(command, index, term) as pysyncobj keeps log entries."""


def trim_append_entries(
    message: dict[str, Any], entry_at: Callable[[int], RaftEntry | None], last_index: int
) -> dict[str, Any]:
    """Drop the part of an AppendEntries this follower already holds.

    pysyncobj's follower truncates its log after `prevLogIdx` whenever it is
    longer, conflict or not. A leader rewinds a follower's next index to the
    follower's last *reported* position while later appends are still in
    flight, so overlapping appends are routine, and the truncation can cut
    entries the follower already acknowledged (and applied) - entries the
    leader may have counted toward a commit. Raft only truncates on a
    conflict. This rewrites an append whose entries all match ours, and
    whose start is behind our log, to start at our last entry, so pysyncobj
    never truncates a matching tail. Anything that looks like a conflict is
    passed through unchanged for the standard handling.

    Our entries beyond the message are kept only if they carry the message's
    term (terms never decrease along a log), i.e. they came from this same
    leader and are therefore in its log.
    """
    prev = message.get("prevLogIdx")
    entries: list[RaftEntry] = message.get("entries") or []
    if prev is None or last_index <= prev:
        return message
    mine = entry_at(prev)
    if mine is None or mine[2] != message.get("prevLogTerm"):
        return message
    for _, idx, term in entries:
        if idx > last_index:
            break
        have = entry_at(idx)
        if have is None or have[2] != term:
            return message
    end = entries[-1][1] if entries else prev
    if end < last_index:
        first_extra, last = entry_at(end + 1), entry_at(last_index)
        if (
            first_extra is None
            or last is None
            or not (first_extra[2] == last[2] == message.get("term"))
        ):
            return message
    last_entry = entry_at(last_index)
    if last_entry is None:
        return message
    out = dict(message)
    out["prevLogIdx"], out["prevLogTerm"] = last_index, last_entry[2]
    out["entries"] = [e for e in entries if e[1] > last_index]
    return out


def rejection_hint(
    proposed: int, mismatch: bool, floor: int | None, commit_index: int, first_index: int
) -> tuple[int, int | None]:
    """The next index a follower names when it rejects an append, and its new floor.

    pysyncobj's follower answers a term mismatch at `prevLogIdx` with
    "retry from prevLogIdx" (one entry back per round trip) and an append that
    starts past its log's end with "retry from my last entry + 1". A follower
    holding a stale tail (a deposed leader's uncommitted entries) receives both
    kinds while the leader keeps sending optimistically from its own end, so
    the second answer keeps undoing the first's progress: measured in
    `kvdir chaos`, a deposed leader stayed stuck for minutes, through a
    restart, never applying again.

    Instead, a mismatch proves our tail conflicts, and every entry up to our
    commit index is in every later leader's log (it is committed), so we name
    commit index + 1 and keep it as a *floor*: until an append succeeds, no
    rejection names anything above it. The leader then sends from a matching
    entry and the conflicting tail is replaced in one round trip. The floor
    never goes below the first entry we still hold (compaction), so the
    leader's prevLogIdx is always one we can check.
    """
    if mismatch:
        floor = max(min(proposed, commit_index + 1), first_index + 1)
    if floor is not None:
        proposed = min(proposed, floor)
    return proposed, floor
