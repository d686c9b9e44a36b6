"""`rejection_hint`: a follower with a stale tail is repaired in one round trip.

pysyncobj's follower rewinds the leader one entry per term mismatch but
answers an append that starts past its log's end with "my last entry + 1",
which undoes that progress while the leader sends optimistically from its own
end; a deposed leader's stale tail could then never be replaced.
"""

from __future__ import annotations

from kvdir.directory.consensus.fixes import rejection_hint


def test_a_mismatch_rewinds_to_the_commit_index_and_sets_a_floor() -> None:
    assert rejection_hint(2100, True, None, 2078, 0) == (2079, 2079)


def test_past_the_end_answers_never_rise_above_the_floor() -> None:
    # The leader sent from its own end (beyond our log of 2100 entries).
    assert rejection_hint(2101, False, 2079, 2078, 0) == (2079, 2079)


def test_without_a_floor_a_lagging_follower_keeps_pysyncobjs_answer() -> None:
    assert rejection_hint(2101, False, None, 2078, 0) == (2101, None)


def test_a_mismatch_below_the_commit_index_is_answered_as_is() -> None:
    assert rejection_hint(50, True, None, 2078, 0) == (50, 50)


def test_the_floor_never_goes_below_the_first_entry_still_held() -> None:
    # After compaction our log starts at index 5000: the leader must send
    # a prevLogIdx we can still check.
    assert rejection_hint(6000, True, None, 3000, 5000) == (5001, 5001)


def test_the_answers_converge_whatever_order_they_are_sent_in() -> None:
    """Replay a follower's rejections in the interleaving that livelocked pysyncobj."""
    floor = None
    answers = []
    for proposed, mismatch in [
        (2101, False),
        (2100, True),
        (2101, False),
        (2099, True),
        (2101, False),
    ]:
        hint, floor = rejection_hint(proposed, mismatch, floor, 2078, 0)
        answers.append(hint)
    assert answers[0] == 2101  # before any mismatch: pysyncobj's answer
    assert answers[1:] == [2079, 2079, 2079, 2079]
