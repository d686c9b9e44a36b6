"""`plan_append`: a follower cuts only at the first conflict, never a committed entry.

pysyncobj truncates a follower's log after `prevLogIdx` whenever the log is
longer, even when nothing conflicts; overlapping appends are routine (the
leader rewinds its next index to the follower's last report while later
appends are in flight, and messages are delayed or retried). These cases pin
down how a message is rewritten so that pysyncobj's handling ends where
Raft's does, and what the follower may then claim. (The same rules through a
real replica: tests/integration/test_raft_holes.py.)
"""

from __future__ import annotations

from typing import Any

from kvdir.directory.consensus.fixes import AppendPlan, RaftEntry, plan_append


def log_of(terms: list[int]) -> dict[int, RaftEntry]:
    """A log with entry i (from 1) of term terms[i-1]."""
    return {i: (f"c{i}".encode(), i, t) for i, t in enumerate(terms, start=1)}


def append(
    prev: int, prev_term: int, entries: list[tuple[int, int]], term: int, commit: int = 0
) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": commit,
        "prevLogIdx": prev,
        "prevLogTerm": prev_term,
        "entries": [(f"c{i}".encode(), i, t) for i, t in entries],
    }


def plan(log: dict[int, RaftEntry], msg: dict[str, Any], commit: int = 0) -> AppendPlan:
    return plan_append(msg, log.get, max(log), commit)


def starts(out: dict[str, Any] | None) -> tuple[int, list[int]]:
    assert out is not None
    return out["prevLogIdx"], [e[1] for e in out["entries"]]


def test_overlap_inside_our_log_of_the_same_term_is_a_heartbeat_at_our_end() -> None:
    log = log_of([1, 1, 2, 2, 2])
    p = plan(log, append(2, 1, [(3, 2), (4, 2)], term=2))
    assert starts(p.message) == (5, []) and p.proven_end is None
    assert p.message is not None and p.message["prevLogTerm"] == 2


def test_overlap_that_extends_our_log_keeps_only_the_new_entries() -> None:
    log = log_of([1, 1, 2])
    p = plan(log, append(1, 1, [(2, 1), (3, 2), (4, 2), (5, 2)], term=2))
    assert starts(p.message) == (3, [4, 5]) and p.proven_end is None


def test_a_conflict_is_cut_exactly_there_not_at_prev() -> None:
    log = log_of([1, 1, 1, 1, 1])  # entries 4-5 from an old leader of term 1
    p = plan(log, append(1, 1, [(2, 1), (3, 1), (4, 3), (5, 3)], term=3), commit=2)
    assert starts(p.message) == (3, [4, 5]) and p.conflict_at == 4


def test_a_conflict_at_or_below_the_commit_index_drops_the_message() -> None:
    log = log_of([1, 1, 1, 1])
    p = plan(log, append(2, 1, [(3, 3)], term=3), commit=3)
    assert p.message is None and p.conflict_at == 3
    p = plan(log, append(2, 1, [(3, 3)], term=3), commit=2)
    assert starts(p.message) == (2, [3])


def test_a_tail_of_an_older_term_is_kept_but_not_vouched_for() -> None:
    # The case: a stale append whose entries all match, to a follower whose
    # tail beyond it carries an earlier term than the message's.
    log = log_of([1, 1, 1, 1])
    p = plan(log, append(1, 1, [(2, 1)], term=2, commit=4))
    assert starts(p.message) == (4, [])  # nothing of ours is cut
    assert p.proven_end == 2  # the answer claims 2
    assert p.message is not None and p.message["commit_index"] == 2  # nor applied past it


def test_a_heartbeat_behind_our_end_proves_only_prev() -> None:
    log = log_of([1, 1, 1, 1])
    p = plan(log, append(2, 1, [], term=2, commit=3))
    assert starts(p.message) == (4, []) and p.proven_end == 2
    assert p.message is not None and p.message["commit_index"] == 2


def test_a_tail_ending_in_the_leaders_own_term_is_vouched_for() -> None:
    log = log_of([1, 1, 1, 2])  # entry 4 of term 2: only term 2's leader made it
    p = plan(log, append(1, 1, [(2, 1)], term=2, commit=4))
    assert starts(p.message) == (4, []) and p.proven_end is None
    assert p.message is not None and p.message["commit_index"] == 4


def test_prev_mismatch_and_messages_at_or_past_our_end_are_untouched() -> None:
    log = log_of([1, 1, 2])
    bad_prev = append(2, 2, [(3, 2)], term=2)  # our entry 2 has term 1
    assert plan(log, bad_prev).message is bad_prev
    at_end = append(3, 2, [(4, 2)], term=2)
    assert plan(log, at_end).message is at_end
    heartbeat = append(3, 2, [], term=2)
    assert plan(log, heartbeat).message is heartbeat
    past_end = append(5, 2, [(6, 2)], term=2)
    assert plan(log, past_end).message is past_end


def test_unknown_prev_entry_is_untouched() -> None:
    log = {i: e for i, e in log_of([1, 1, 1, 1]).items() if i >= 3}  # compacted below 3
    msg = append(1, 1, [(2, 1), (3, 1)], term=1)
    assert plan_append(msg, log.get, 4, 0).message is msg


def test_the_input_message_is_never_modified() -> None:
    log = log_of([1, 1, 1, 1])
    msg = append(1, 1, [(2, 1)], term=2, commit=4)
    before = {k: (list(v) if isinstance(v, list) else v) for k, v in msg.items()}
    plan(log, msg)
    assert msg == before
