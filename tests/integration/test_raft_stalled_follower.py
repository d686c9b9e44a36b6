"""A follower whose Raft thread was held up past its election timeout does not depose a live leader.

Three real replicas in this process (pysyncobj, kvdir's journal, real TCP on
loopback, their own tick threads). One follower's disk is made slow once: the
fdatasync at the top of its next tick (the journal sync of an append it just
read) takes longer than the longest election timeout, as a journal sync did
behind a compaction's dump writeback on the bench host. The leader's
heartbeats keep arriving in its socket meanwhile. pysyncobj checks the
election deadline before it reads the socket, so the follower used to
campaign and bump every term; it must read first and stay a follower.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from kvdir.directory import codec
from kvdir.directory.commands import RegisterNode
from kvdir.directory.consensus._replica import Hooks, Replica
from kvdir.directory.consensus.sync import Durability, Syncer, fsync_dir
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.local import free_ports, wait_for

pytestmark = pytest.mark.integration

WAIT_S = 20.0
TUNING = replace(
    RaftTuning(),
    election_min_s=1.0,
    election_max_s=2.0,
    leader_fallback_s=4.0,
    connection_timeout_s=6.0,
)
"""Timeouts of seconds, not the default 150-300 ms: three replicas share this
process's GIL, and on CI's loaded 2 cores another replica's tick once slipped
past a 300 ms timeout on its own (a second election, terms [2, 2, 2]), which is
not what this test is about. Links outlive the stall, so the held follower finds
the heartbeats in its socket, as in production."""
STALL_S = TUNING.election_max_s + 0.15
"""Longer than any follower's election timeout: the held tick would campaign."""


class SlowOnce:
    """A disk whose next fdatasync, once armed, takes STALL_S (a writeback queue ahead of it)."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.stalled = threading.Event()

    def file(self, fd: int) -> None:
        os.fdatasync(fd)
        if self.armed.is_set():
            self.armed.clear()
            self.stalled.wait(STALL_S)  # never set: the wait is the stall itself
            self.stalled.set()


@contextmanager
def cluster(tmp_path: Path) -> Iterator[list[tuple[Replica, SlowOnce]]]:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    out: list[tuple[Replica, SlowOnce]] = []
    try:
        for i, me in enumerate(addrs):
            slow = SlowOnce()
            peers = [a for a in addrs if a != me]
            r = Replica(
                me, peers, str(tmp_path / f"r{i}"), TUNING, None, "", False, None, me,
                Durability.POWER_LOSS, Hooks(syncer=Syncer(slow.file, fsync_dir)),
            )  # fmt: skip
            out.append((r, slow))
        yield out
    finally:
        for r, _ in out:
            r.destroy()
        for r, _ in out:
            _stopped(r)


def _stopped(r: Replica) -> None:
    wait_for(lambda: not r.tick_thread_alive(), WAIT_S, "a Raft thread to stop")


def _leader(replicas: list[Replica]) -> Replica | None:
    leaders = [r for r in replicas if r.role() == 2]
    return leaders[0] if len(leaders) == 1 else None


def _commit(leader: Replica, node: str) -> None:
    done = threading.Event()
    blob = codec.encode(RegisterNode(node, "h", "ep:1", ("tcp",), 1, 60_000, 0))
    leader.propose_blob(blob, lambda _res, _err: done.set())
    assert done.wait(WAIT_S), "the write did not commit"


def test_a_follower_held_past_its_timeout_reads_the_heartbeats_before_campaigning(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path) as members:
        replicas = [r for r, _ in members]
        wait_for(lambda: _leader(replicas) is not None, WAIT_S, "a leader")
        leader = _leader(replicas)
        assert leader is not None
        _commit(leader, "n0")  # the leader's no-op and a write, applied everywhere
        wait_for(lambda: all(r.raftLastApplied >= leader.raftLastApplied for r in replicas),
                 WAIT_S, "every replica to apply the first write")  # fmt: skip
        slowed, slow = next((r, s) for r, s in members if r is not leader)
        term = leader.raftCurrentTerm
        slow.armed.set()
        _commit(leader, "n1")  # the follower reads the append; its next tick's sync stalls
        wait_for(slow.stalled.is_set, WAIT_S, "the slowed follower's stalled sync")
        _commit(leader, "n2")  # time for a campaign to show, had the follower started one
        wait_for(lambda: slowed.raftLastApplied >= leader.raftLastApplied, WAIT_S,
                 "the slowed follower to catch up")  # fmt: skip
        assert slowed.ticks.longest_s >= STALL_S
        assert [r.raftCurrentTerm for r in replicas] == [term] * 3
        assert _leader(replicas) is leader
        assert slowed.role() == 0
