"""`trim_append_entries`: a follower never truncates entries that match the leader's.

pysyncobj truncates a follower's log after `prevLogIdx` whenever the log is
longer, even when nothing conflicts; overlapping appends are routine (the
leader rewinds its next index to the follower's last report while later
appends are in flight). These cases pin down when the message is rewritten and
when it is passed through for pysyncobj's standard conflict handling.
"""

from __future__ import annotations

from typing import Any

from kvdir.directory.consensus.fixes import RaftEntry, trim_append_entries


def log_of(terms: list[int]) -> dict[int, RaftEntry]:
    """A log with entry i (from 1) of term terms[i-1]."""
    return {i: (f"c{i}".encode(), i, t) for i, t in enumerate(terms, start=1)}


def append(prev: int, prev_term: int, entries: list[tuple[int, int]], term: int) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": 0,
        "prevLogIdx": prev,
        "prevLogTerm": prev_term,
        "entries": [(f"c{i}".encode(), i, t) for i, t in entries],
    }


def trim(log: dict[int, RaftEntry], msg: dict[str, Any]) -> dict[str, Any]:
    return trim_append_entries(msg, log.get, max(log))


def test_overlap_inside_our_log_is_reduced_to_a_heartbeat_at_our_end() -> None:
    log = log_of([1, 1, 2, 2, 2])
    out = trim(log, append(2, 1, [(3, 2), (4, 2)], term=2))
    assert out["prevLogIdx"] == 5 and out["prevLogTerm"] == 2 and out["entries"] == []


def test_overlap_that_extends_our_log_keeps_only_the_new_entries() -> None:
    log = log_of([1, 1, 2])
    out = trim(log, append(1, 1, [(2, 1), (3, 2), (4, 2), (5, 2)], term=2))
    assert out["prevLogIdx"] == 3
    assert [e[1] for e in out["entries"]] == [4, 5]


def test_a_conflicting_entry_is_passed_through_for_truncation() -> None:
    log = log_of([1, 1, 1, 1])  # entries 3-4 from an old leader of term 1
    msg = append(2, 1, [(3, 3), (4, 3)], term=3)
    assert trim(log, msg) is msg


def test_a_tail_from_an_older_term_is_not_vouched_for() -> None:
    # Our entries beyond the message carry term 1, the message comes from term 2:
    # they may not be in this leader's log, so the standard handling applies.
    log = log_of([1, 1, 1, 1])
    msg = append(1, 1, [(2, 1)], term=2)
    assert trim(log, msg) is msg


def test_a_tail_of_the_leaders_own_term_is_kept() -> None:
    log = log_of([1, 2, 2, 2])
    out = trim(log, append(1, 1, [(2, 2)], term=2))
    assert out["prevLogIdx"] == 4 and out["entries"] == []


def test_prev_mismatch_and_messages_at_or_past_our_end_are_untouched() -> None:
    log = log_of([1, 1, 2])
    bad_prev = append(2, 2, [(3, 2)], term=2)  # our entry 2 has term 1
    assert trim(log, bad_prev) is bad_prev
    at_end = append(3, 2, [(4, 2)], term=2)
    assert trim(log, at_end) is at_end
    heartbeat = append(3, 2, [], term=2)
    assert trim(log, heartbeat) is heartbeat


def test_unknown_prev_entry_is_untouched() -> None:
    log = {i: e for i, e in log_of([1, 1, 1, 1]).items() if i >= 3}  # compacted below 3
    msg = append(1, 1, [(2, 1), (3, 1)], term=1)
    assert trim_append_entries(msg, log.get, 4) is msg
