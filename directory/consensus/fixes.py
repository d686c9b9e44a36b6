"""Safety fixes to pysyncobj's follower and its chunked appends, as pure functions
of the log and the messages (no I/O, no clock).

`_replica.Replica` calls them from its overrides of pysyncobj's handlers and
from its transport; they are here, apart, so unit tests can drive them with
plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pysyncobj.pickle as raft_pickle  # how pysyncobj frames an entry sent in chunks

RaftEntry = tuple[bytes, int, int]
"""(command, index, term) as pysyncobj keeps log entries."""


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """What a follower does with one AppendEntries (see `plan_append`)."""

    message: dict[str, Any] | None
    """The message to hand to pysyncobj; None: drop it (it would cut a committed entry)."""
    proven_end: int | None = None
    """The last index the append proves we share with its leader, when our log
    goes on past it: the success answer and the commit index stop there."""
    conflict_at: int | None = None
    """The index of the first entry that conflicts with the message, if any."""


def plan_append(
    message: dict[str, Any],
    entry_at: Callable[[int], RaftEntry | None],
    last_index: int,
    commit_index: int,
) -> AppendPlan:
    """Raft's append rule on top of pysyncobj's follower, which cuts too much.

    pysyncobj's follower deletes every entry after `prevLogIdx` whenever its
    log is longer, conflict or not. Overlapping appends are routine (a leader
    rewinds a follower's next index while later appends are in flight, and a
    message may be delayed or retried), and that cut can remove entries the
    follower already acknowledged - entries the leader may have counted
    toward a commit - and the journal makes the cut durable at once.

    Raft cuts only at the first entry whose term differs from the message's.
    So the message is rewritten to start at that entry (pysyncobj then cuts
    exactly there), or, when nothing conflicts, at our last entry with only
    the entries we lack (pysyncobj then cuts nothing). A conflict at or below
    `commit_index` cannot come from a legitimate leader (a committed entry is
    in every later leader's log): the message is dropped.

    When our log goes on past the end of a message that conflicts nowhere,
    those extra entries are unproven: they may be a deposed leader's. They are
    kept (Raft never cuts without a conflict) but not vouched for - the
    success answer names the message's end (`proven_end`), and the commit
    index the message carries is capped there, so they are not applied on
    its strength - unless our last entry carries the message's term: one
    leader per term, and a leader's log never loses entries, so then all of
    our log is in the leader's.
    """
    prev = message.get("prevLogIdx")
    entries: list[RaftEntry] = message.get("entries") or []
    if prev is None or last_index <= prev:
        return AppendPlan(message)  # nothing of ours after prev: pysyncobj cuts nothing
    mine = entry_at(prev)
    if mine is None or mine[2] != message.get("prevLogTerm"):
        return AppendPlan(message)  # pysyncobj rejects it and cuts nothing
    for pos, (_, idx, term) in enumerate(entries):
        if idx > last_index:
            return AppendPlan(_starting_at(message, entries, pos, entry_at(idx - 1)))
        have = entry_at(idx)
        if have is None:
            return AppendPlan(message)  # not contiguous: let pysyncobj refuse it
        if have[2] != term:
            if idx <= commit_index:
                return AppendPlan(None, conflict_at=idx)
            return AppendPlan(
                _starting_at(message, entries, pos, entry_at(idx - 1)), conflict_at=idx
            )
    last = entry_at(last_index)
    if last is None:
        return AppendPlan(message)
    out = _starting_at(message, entries, len(entries), last)
    if last[2] == message.get("term"):
        return AppendPlan(out)
    end = entries[-1][1] if entries else prev
    out["commit_index"] = min(int(message.get("commit_index", 0)), end)
    return AppendPlan(out, proven_end=end)


def _starting_at(
    message: dict[str, Any], entries: list[RaftEntry], pos: int, before: RaftEntry | None
) -> dict[str, Any]:
    """`message` sent as if its entries started at `pos` (after our entry `before`)."""
    assert before is not None  # every index from prev to our last is in our log
    out = dict(message)
    out["prevLogIdx"], out["prevLogTerm"] = before[1], before[2]
    out["entries"] = entries[pos:]
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


def finished_transmission(buffered: Any, message: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk pysyncobj flags as the last of a big entry, as an ordinary append.

    pysyncobj's follower unpickles the chunks it gathered and appends the
    entry with no further check; as an ordinary AppendEntries carrying that
    one entry it meets `plan_append` like any other. When the chunks do not
    yet make a whole entry (a leader of an older kvdir flagged chunks as the
    last too early, see `ChunkFraming`) the chunk is relabelled "process", so
    it is gathered instead of aborting the tick with a traceback. None: there
    is nothing to add it to (no first chunk), or it is not a log entry.
    """
    if not isinstance(buffered, bytes) or not isinstance(message.get("data"), bytes):
        return None
    try:
        entry = raft_pickle.loads(buffered + message["data"])
    except Exception:  # a truncated pickle fails in many ways; the rest is still coming
        return dict(message, transmission="process")
    if not (
        isinstance(entry, tuple)
        and len(entry) == 3
        and isinstance(entry[0], bytes)
        and isinstance(entry[1], int)
        and isinstance(entry[2], int)
    ):
        return None
    out = {k: v for k, v in message.items() if k not in ("transmission", "data")}
    out["entries"] = [entry]
    return out


class ChunkFraming:
    """Labels the chunks of a big entry by its pickled length (the leader's side).

    pysyncobj sends an entry of `appendEntriesBatchSizeBytes` or more as
    chunks of its pickled form but flags a chunk as the last ("finish") once
    it reaches the *raw* command's length; the pickle is larger (protocol 2
    spells every byte >= 0x80 in two), so followers got several "finish"
    chunks, failed to unpickle the early ones and aborted those ticks. This
    sees every message the transport sends: at a "start" it pickles the entry
    being sent (the one after `prevLogIdx`) the same way, checks that the
    chunk is its beginning, and from then on counts the bytes, so exactly the
    chunk that completes the entry is "finish". Anything it cannot account
    for is passed on unchanged.
    """

    def __init__(self, entry_at: Callable[[int], RaftEntry | None]) -> None:
        self._entry_at = entry_at
        self._left: dict[Any, int] = {}
        """Per peer: pickled bytes of the entry being sent that are still to come."""
        self._last: tuple[tuple[int, int, int], bytes, int] | None = None
        """The last entry measured: (index, term, command bytes), its first chunk and
        its pickled size (every peer gets the same entry; pickle it once)."""

    def frame(self, node: Any, message: Any) -> Any:
        kind = message.get("transmission") if isinstance(message, dict) else None
        if kind is None:
            return message
        data = message.get("data")
        if kind == "start":
            self._left.pop(node, None)
            size = self._pickled_size(int(message.get("prevLogIdx", -1)) + 1, data)
            if size is not None:
                self._left[node] = size - len(data)
            return message
        left = self._left.get(node)
        if left is None or not isinstance(data, bytes):
            return message
        left -= len(data)
        if left > 0:
            self._left[node] = left
            label = "process"
        else:
            del self._left[node]
            label = "finish"
        return message if label == kind else dict(message, transmission=label)

    def _pickled_size(self, index: int, first: Any) -> int | None:
        """The pickled size of our entry at `index` if `first` is its first chunk."""
        entry = self._entry_at(index)
        if entry is None or not isinstance(first, bytes):
            return None
        key = (entry[1], entry[2], len(entry[0]))
        if self._last is None or self._last[0] != key or self._last[1] != first:
            whole = raft_pickle.dumps(entry)
            if not whole.startswith(first):
                return None
            self._last = (key, first, len(whole))
        return self._last[2]
