"""The Raft thread's view of the command queue (`_replica._LeaderQueue`): a write is
handed over only while its replica still leads the term it was taken in.

The replica here is a stand-in with `leads(term)` and the refusal counter: the
queue reads nothing else of it (the end-to-end case, with real replicas, is the
simulator's regression seed 31 in tests/sim/test_raft_sim.py)."""

from __future__ import annotations

import queue
from typing import Any

import pytest
from pysyncobj import FAIL_REASON

from kvdir.directory.consensus._replica import _LeaderQueue, _Termed


class _Seat:
    def __init__(self, term: int | None) -> None:
        self.term = term  # the term it leads now (None: not leading)
        self.refused_writes = 0

    def leads(self, term: int) -> bool:
        return self.term == term


def _answers() -> tuple[list[Any], Any]:
    got: list[Any] = []
    return got, lambda result, error: got.append((result, error))


def test_a_write_is_handed_over_only_in_the_term_it_was_taken_in() -> None:
    seat = _Seat(term=7)
    q = _LeaderQueue(seat, 10)  # type: ignore[arg-type]
    old, old_cb = _answers()
    now, now_cb = _answers()
    q.put_nowait((b"taken in term 6", _Termed(old_cb, 6)))
    q.put_nowait((b"taken in term 7", _Termed(now_cb, 7)))
    command, callback = q.get_nowait()
    assert command == b"taken in term 7"  # term 6's was refused on the way
    assert old == [(None, FAIL_REASON.NOT_LEADER)] and seat.refused_writes == 1
    callback("applied", FAIL_REASON.SUCCESS)  # pysyncobj calls the wrapper on commit
    assert now == [("applied", FAIL_REASON.SUCCESS)]
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_a_replica_that_stopped_leading_refuses_its_writes_and_passes_the_rest() -> None:
    seat = _Seat(term=None)
    q = _LeaderQueue(seat, 10)  # type: ignore[arg-type]
    write, write_cb = _answers()
    barrier, barrier_cb = _answers()
    q.put_nowait((b"write", _Termed(write_cb, 3)))
    q.put_nowait((b"barrier", barrier_cb))  # no term: may travel to the leader
    q.put_nowait((b"a peer's forwarded command", ("peer", 12)))
    assert q.get_nowait() == (b"barrier", barrier_cb)
    assert q.get_nowait() == (b"a peer's forwarded command", ("peer", 12))
    assert write == [(None, FAIL_REASON.NOT_LEADER)] and barrier == []
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_the_bound_still_holds() -> None:
    q = _LeaderQueue(_Seat(term=1), 1)  # type: ignore[arg-type]
    q.put_nowait((b"one", None))
    with pytest.raises(queue.Full):
        q.put_nowait((b"two", None))
