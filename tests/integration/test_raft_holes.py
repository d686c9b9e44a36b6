"""Raft holes of issue 29, driven through one real replica in this process.

A real `Replica` (pysyncobj 0.3.17, kvdir's journal on disk, the table) bound
on loopback, its one peer never started: nothing reaches it but what a test
hands to its message handler, on its own Raft thread, so every step is exact.

- Hole 1: a follower truncates only at the first conflicting entry, never a
  matching or committed one, and answers only for what an append proved.
- Hole 2: a restart between a compaction's dump rename and its log trim keeps
  the entries after the dump; an older dump never replaces a newer one.
- Found by the seeded simulator on the way: a snapshot message never commits
  a follower's unproven entries, and a vote answer delivered twice counts once.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pysyncobj.pickle as raft_pickle
import pytest
from pysyncobj.node import TCPNode

from kvdir.directory import snapshot
from kvdir.directory.consensus._replica import Replica
from kvdir.directory.consensus.journal import LOG_FILE, read_only
from kvdir.directory.consensus.pysyncobj_log import DUMP_FILE, command_of
from kvdir.directory.consensus.syncobj import RaftConsensus
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.table import Table
from kvdir.local import free_ports, wait_for
from tests.unit.helpers import chain, publish_cmd, register

pytestmark = pytest.mark.integration

T = TypeVar("T")
MEMBERSHIP = b"\x02"  # pysyncobj's membership change entry: pickled [kind, id, node]
NO_OP = b"\x01"  # pysyncobj's no-op entry: applying it touches nothing
WAIT_S = 10.0


class RaftThread:
    """Runs a function on a replica's Raft thread (pysyncobj's tick callbacks)."""

    def __init__(self, replica: Replica) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        replica.addOnTickCallback(self._drain)

    def _drain(self) -> None:
        while not self._jobs.empty():
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed back to the test thread
                box.append((False, e))
            done.set()

    def run(self, fn: Callable[[], T]) -> T:
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        assert done.wait(WAIT_S), "the Raft thread did not run the job"
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]


@contextmanager
def follower(data_dir: Path) -> Iterator[tuple[Replica, RaftThread, list[dict[str, Any]]]]:
    """A replica whose one peer (the "leader" of these tests) never runs.

    Yields the replica, its Raft thread and the answers it sends the leader.
    """
    me, peer = (f"127.0.0.1:{p}" for p in free_ports(2))
    r = Replica(me, [peer], str(data_dir), RaftTuning(), None, "", False, None, me)
    sent: list[dict[str, Any]] = []
    transport = r._SyncObj__transport
    real_send = transport.send

    def record(node: Any, message: Any) -> Any:
        if isinstance(message, dict) and message.get("type") == "next_node_idx":
            sent.append(message)
        return real_send(node, message)

    transport.send = record
    try:
        r.waitBinded()
        yield r, RaftThread(r), sent
    finally:
        r.destroy()
        wait_for(lambda: not r.tick_thread_alive(), WAIT_S, "the Raft thread to stop")


def append(
    term: int, prev: tuple[int, int], entries: list[tuple[int, int]], commit: int
) -> dict[str, Any]:
    """An AppendEntries of no-op entries given as (index, term)."""
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": commit,
        "prevLogIdx": prev[0],
        "prevLogTerm": prev[1],
        "entries": [(NO_OP, i, t) for i, t in entries],
    }


def deliver(r: Replica, raft: RaftThread, message: dict[str, Any]) -> None:
    leader = next(iter(r.otherNodes))
    raft.run(lambda: r._SyncObj__onMessageReceived(leader, message))
    raft.run(lambda: None)  # one more tick: held answers are released after its sync


def log_of(r: Replica, raft: RaftThread) -> list[tuple[int, int]]:
    """(index, term) of every entry in memory, checked against the journal on disk."""

    def read() -> list[tuple[int, int]]:
        r.kvdir_journal.sync()
        mem = [(i, t) for _, i, t in r.kvdir_journal.log.entries]
        disk = [(i, t) for _, i, t in read_only(r.kvdir_journal.log.path)]
        assert mem == disk
        return mem

    return raft.run(read)


# ------------------------------------------------------------------ hole 1


def test_a_stale_append_never_cuts_matching_committed_entries(tmp_path: Path) -> None:
    """The issue's case: our tail holds entries of an earlier term than the append's."""
    with follower(tmp_path) as (r, raft, sent):
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1)], commit=1))
        deliver(r, raft, append(2, (3, 1), [(4, 2)], commit=4))
        assert log_of(r, raft) == [(1, 0), (2, 1), (3, 1), (4, 2)]
        assert r.raftCommitIndex == 4
        # The same leader's earlier append, delayed: it matches everything it carries.
        deliver(r, raft, append(2, (1, 0), [(2, 1)], commit=1))
        assert log_of(r, raft) == [(1, 0), (2, 1), (3, 1), (4, 2)]
        assert r.raftCommitIndex == 4
        assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 5  # entry 4 is term 2's


def test_an_append_that_would_cut_a_committed_entry_is_dropped(tmp_path: Path) -> None:
    with follower(tmp_path) as (r, raft, sent):
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1), (4, 1)], commit=4))
        assert r.raftCommitIndex == 4
        answers = len(sent)
        deliver(r, raft, append(3, (2, 1), [(3, 3)], commit=4))  # "conflicts" at 3 <= 4
        assert log_of(r, raft) == [(1, 0), (2, 1), (3, 1), (4, 1)]
        assert r.raftCommitIndex == 4
        assert len(sent) == answers  # dropped: no answer either


def test_an_unproven_tail_is_kept_but_neither_committed_nor_vouched_for(tmp_path: Path) -> None:
    with follower(tmp_path) as (r, raft, sent):
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1), (4, 1)], commit=1))
        # A new leader's heartbeat proves entries up to 2 only; 3-4 may be a deposed
        # leader's. Nothing conflicts, so nothing is cut; but they must not be
        # applied on the strength of this commit index, nor claimed in the answer.
        deliver(r, raft, append(2, (2, 1), [], commit=3))
        assert log_of(r, raft) == [(1, 0), (2, 1), (3, 1), (4, 1)]
        assert r.raftCommitIndex == 2 and r.raftLastApplied <= 2
        assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 3
        # The real conflict cuts exactly there, and the commit index follows the leader.
        deliver(r, raft, append(2, (2, 1), [(3, 2)], commit=3))
        assert log_of(r, raft) == [(1, 0), (2, 1), (3, 2)]
        assert r.raftCommitIndex == 3
        assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 4


def test_entries_past_the_message_of_the_same_leader_are_vouched_for(tmp_path: Path) -> None:
    with follower(tmp_path) as (r, raft, sent):
        deliver(r, raft, append(2, (1, 0), [(2, 2), (3, 2), (4, 2)], commit=1))
        deliver(r, raft, append(2, (1, 0), [(2, 2)], commit=4))  # reordered: older, shorter
        assert log_of(r, raft) == [(1, 0), (2, 2), (3, 2), (4, 2)]
        assert r.raftCommitIndex == 4
        assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 5


def test_a_snapshot_install_keeps_the_log_after_it_but_commits_only_the_snapshot(
    tmp_path: Path,
) -> None:
    with follower(tmp_path / "data") as (r, raft, sent):
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1), (4, 1), (5, 1), (6, 1)], commit=1))
        # While the leader's own dump is being written it sends None for a chunk:
        # that proves nothing about our log either.
        busy = {"type": "append_entries", "term": 2, "commit_index": 6, "serialized": None}
        deliver(r, raft, busy)
        assert r.raftCommitIndex == 1 and r.raftLastApplied == 1
        dump = tmp_path / "leader-snapshot.bin"
        meta = {"cluster": sorted([r.selfNode.address, *(n.address for n in r.otherNodes)])}
        snapshot.write(snapshot.capture(Table()), str(dump), meta, [(NO_OP, 4, 1), (NO_OP, 3, 1)])
        data = dump.read_bytes()
        chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)] + [b""]
        for k, chunk in enumerate(chunks):  # pysyncobj's framing: the empty chunk is the last
            install = {
                "type": "append_entries",
                "term": 2,
                "commit_index": 6,
                "serialized": (chunk, k == 0, k == len(chunks) - 1),
            }
            deliver(r, raft, install)
        # Entry 4 (term 1) matches the snapshot's last entry: 5-6 stay, unproven.
        assert log_of(r, raft) == [(3, 1), (4, 1), (5, 1), (6, 1)]
        assert r.raftCommitIndex == 4 and r.raftLastApplied == 4
        assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 5
        assert r.dump_index == 4


def send_snapshot(r: Replica, raft: RaftThread, path: Path, anchors: list[int]) -> None:
    """The leader's snapshot (an empty table) with these anchors, in pysyncobj's chunks."""
    meta = {"cluster": sorted([r.selfNode.address, *(n.address for n in r.otherNodes)])}
    snapshot.write(snapshot.capture(Table()), str(path), meta, [(NO_OP, i, 1) for i in anchors])
    data = path.read_bytes()
    chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)] + [b""]
    for k, chunk in enumerate(chunks):
        serialized = (chunk, k == 0, k == len(chunks) - 1)
        deliver(
            r,
            raft,
            {"type": "append_entries", "term": 2, "commit_index": 6, "serialized": serialized},
        )


def test_a_snapshot_no_newer_than_the_dump_is_dropped(tmp_path: Path) -> None:
    """Found by the simulator (seed 2797): a duplicate install, older than the dump the
    follower had compacted to since, was renamed over it; the restart then dropped the
    journal (trimmed past the older snapshot) and committed entries were lost."""
    with follower(tmp_path / "data") as (r, raft, sent):
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1), (4, 1), (5, 1), (6, 1)], commit=1))
        send_snapshot(r, raft, tmp_path / "at-4.bin", [4, 3])
        deliver(r, raft, append(2, (6, 1), [], commit=6))
        assert r.dump_index == 4 and r.raftCommitIndex == 6
        dump = Path(r.dump_path)
        ours = dump.read_bytes()
        for anchors in ([4, 3], [3, 2]):  # the same snapshot again, an older one
            send_snapshot(r, raft, tmp_path / f"at-{anchors[0]}.bin", anchors)
            assert dump.read_bytes() == ours and r.dump_index == 4
            assert log_of(r, raft) == [(3, 1), (4, 1), (5, 1), (6, 1)]
            assert r.raftCommitIndex == 6 and r.raftLastApplied == 6
            assert sent[-1]["success"] and sent[-1]["next_node_idx"] == 7
        assert not Path(f"{r.dump_path}.1.tmp").exists()


def test_a_dump_keeps_the_membership_at_its_anchor(tmp_path: Path) -> None:
    """Found by the simulator (seed 8291): pysyncobj stored the membership in memory
    in a dump anchored before an uncommitted change; the change was cut later but the
    dump brought it back at every restart, and the member it dropped voted elsewhere."""
    with follower(tmp_path / "data") as (r, raft, _):
        other = f"127.0.0.1:{free_ports(1)[0]}"
        change = MEMBERSHIP + raft_pickle.dumps(["add", other, TCPNode(other)])
        deliver(r, raft, append(1, (1, 0), [(2, 1), (3, 1)], commit=3))
        message = append(1, (3, 1), [], commit=3)
        message["entries"] = [(change, 4, 1)]
        deliver(r, raft, message)
        assert other in {n.address for n in r.otherNodes}  # made when appended
        done = r.compactions
        anchors = (r.entry_at(3), r.entry_at(2), {r.selfNode, *r.otherNodes})
        raft.run(lambda: r._serialize("unused", anchors))  # a compaction at applied 3
        wait_for(lambda: r.compactions > done, WAIT_S, "the compaction writer")
        _, meta, _ = snapshot.read(r.dump_path)
        assert other not in meta["cluster"] and r.selfNode.address in meta["cluster"]


def test_a_vote_answer_delivered_twice_counts_once(tmp_path: Path) -> None:
    """pysyncobj counted answers, not voters (found by the seeded simulator)."""
    me, *peers = (f"127.0.0.1:{p}" for p in free_ports(5))
    r = Replica(me, peers, str(tmp_path), RaftTuning(), None, "", False, None, me)
    try:
        r.waitBinded()
        raft = RaftThread(r)
        a, b = sorted(r.otherNodes, key=lambda n: n.address)[:2]

        def campaign() -> None:  # what pysyncobj does when its election timer fires
            r._SyncObj__setState(1)  # CANDIDATE
            r._SyncObj__setCurrentTerm(3, r.selfNode.id)
            r._SyncObj__votesCount = 1

        raft.run(campaign)
        vote = {"type": "response_vote", "term": 3}
        raft.run(lambda: r._SyncObj__onMessageReceived(a, vote))
        raft.run(lambda: r._SyncObj__onMessageReceived(a, vote))  # the same answer again
        assert r.role() == 1  # two of five, not three
        raft.run(lambda: r._SyncObj__onMessageReceived(b, vote))
        assert r.role() == 2  # three of five
    finally:
        r.destroy()
        wait_for(lambda: not r.tick_thread_alive(), WAIT_S, "the Raft thread to stop")


# ------------------------------------------------------------------ hole 2


def _run_alone(data_dir: Path, publishes: int) -> str:
    """A lone replica that commits `publishes` Publish commands; returns its address."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    raft = RaftConsensus(addr, [], str(data_dir))
    try:
        raft.wait_bound()
        wait_for(lambda: raft.status().role.name == "LEADER", WAIT_S, "a lone replica to lead")
        t = Table()
        reg = register(t, "n1", lease_ms=600_000)
        assert raft.write(_register_cmd(), WAIT_S).result == reg
        for k in range(publishes):
            assert raft.write(publish_cmd("n1", chain(4, start=4 * k)), WAIT_S).result
    finally:
        _close(raft)
    return addr


def _close(raft: RaftConsensus) -> None:
    """Close and wait until the Raft port is free again (the same address restarts)."""
    raft.close()
    wait_for(lambda: not raft._r.tick_thread_alive(), WAIT_S, "the Raft thread to stop")


def _register_cmd() -> Any:
    from kvdir.directory.commands import RegisterNode

    return RegisterNode("n1", "host", "ep:1", ("tcp",), 1, 600_000, 0)


def _table_at(entries: list[tuple[bytes, int, int]], index: int) -> Table:
    t = Table()
    for cmd, idx, _ in entries:
        c = command_of(cmd)
        if idx <= index and c is not None:
            t.apply(c)
    return t


def _dump_as_compaction_writes_it(
    data_dir: Path, addr: str, entries: list[tuple[bytes, int, int]], index: int
) -> None:
    """The dump a compaction at applied `index` renames into place (before the log trim)."""
    by_index = {e[1]: e for e in entries}
    raft_meta = {"cluster": [addr], "labels": {}}
    image = snapshot.capture(_table_at(entries, index))
    snapshot.write(
        image, str(data_dir / DUMP_FILE), raft_meta, [by_index[index], by_index[index - 1]]
    )


def _restarted_table(data_dir: Path, addr: str, applied: int) -> tuple[bytes, int, int]:
    """Start the lone replica again; its table digest, entries and first log index."""
    raft = RaftConsensus(addr, [], str(data_dir))
    try:
        raft.wait_bound()
        wait_for(lambda: raft.status().applied_index >= applied, WAIT_S, "the replay")
        digest, count = raft.read(lambda t: (t.digest(), t.entries))
        first = raft._r.kvdir_journal.log.entries[0][1]
    finally:
        _close(raft)
    return digest, count, first


def test_a_crash_between_the_dump_rename_and_the_log_trim_loses_nothing(tmp_path: Path) -> None:
    addr = _run_alone(tmp_path, publishes=30)
    entries = read_only(str(tmp_path / LOG_FILE))
    last = entries[-1][1]
    whole = _table_at(entries, last)
    _dump_as_compaction_writes_it(tmp_path, addr, entries, index=last - 10)
    digest, count, first = _restarted_table(tmp_path, addr, last)
    assert count == whole.entries and digest == whole.digest()
    assert first == last - 11  # the log now starts at the dump's anchors
    # And again: the journal and the dump now agree, nothing moves.
    digest, count, first = _restarted_table(tmp_path, addr, last)
    assert count == whole.entries and digest == whole.digest() and first == last - 11


def test_an_older_local_dump_never_replaces_a_newer_one(tmp_path: Path) -> None:
    addr = _run_alone(tmp_path, publishes=30)
    entries = read_only(str(tmp_path / LOG_FILE))
    last = entries[-1][1]
    whole = _table_at(entries, last)
    newer, older = last - 5, last - 20
    _dump_as_compaction_writes_it(tmp_path, addr, entries, index=newer)
    by_index = {e[1]: e for e in entries}
    r = Replica(addr, [], str(tmp_path), RaftTuning(), None, "", False, None, addr)
    try:
        r.waitBinded()
        raft = RaftThread(r)
        wait_for(lambda: int(r.raftLastApplied) >= newer, WAIT_S, "the dump to load")
        done_before = r.compactions + getattr(r, "dumps_discarded", 0)
        # A compaction that captured at `older` finishes only now (say it started
        # before a snapshot install from the leader): its dump must be dropped.
        cluster = {r.selfNode}
        raft.run(lambda: r._serialize("unused", (by_index[older], by_index[older - 1], cluster)))
        wait_for(
            lambda: r.compactions + getattr(r, "dumps_discarded", 0) > done_before,
            WAIT_S,
            "the compaction writer to finish",
        )
        _, _, anchors = snapshot.read(str(tmp_path / DUMP_FILE))
        assert anchors[0][1] == newer
    finally:
        r.destroy()
        wait_for(lambda: not r.tick_thread_alive(), WAIT_S, "the Raft thread to stop")
    digest, count, _ = _restarted_table(tmp_path, addr, last)
    assert count == whole.entries and digest == whole.digest()
    assert os.path.exists(tmp_path / DUMP_FILE)
