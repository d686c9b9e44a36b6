"""pysyncobj's side of the journal: the factory hook, migration, atomic snapshots."""

from __future__ import annotations

import os
from pathlib import Path

import pysyncobj.syncobj as syncobj_module
import pytest
from pysyncobj.journal import createJournal

from kvdir.directory import snapshot
from kvdir.directory.consensus import pysyncobj_journal as glue
from kvdir.directory.consensus.acks import AckGate
from kvdir.directory.consensus.journal import JournalFailed, LogFile
from kvdir.directory.consensus.sync import Syncer, fsync_dir
from kvdir.directory.table import Table
from tests.unit.helpers import chain, must_publish, must_register


def test_the_factory_hands_a_registered_journal_to_pysyncobj_once(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    path = str(tmp_path / glue.LOG_FILE)
    glue.register(path, j)
    assert syncobj_module.createJournal(path) is j
    other = syncobj_module.createJournal(None)  # anything unregistered: pysyncobj's own
    assert type(other).__name__ == "MemoryJournal"
    j._destroy()


def test_the_journal_speaks_pysyncobj_s_interface(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    j.add(b"\x01", 1, 0)
    j.add(b"a", 2, 1)
    j.add(b"b", 3, 1)
    assert len(j) == 3 and j[-1] == (b"b", 3, 1) and j[1:] == [(b"a", 2, 1), (b"b", 3, 1)]
    j.setCurrentTerm(2, "127.0.0.1:7001")
    j.setRaftCommitIndex(3)
    assert j.unsynced and j.sync() == 3 and not j.unsynced
    j.deleteEntriesFrom(2)
    j.deleteEntriesTo(1)
    j.onOneSecondTimer()
    j._destroy()
    again = glue.open_journal(str(tmp_path))
    assert [again[i] for i in range(len(again))] == [(b"a", 2, 1)]
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (2, "127.0.0.1:7001")
    assert again.getRaftCommitIndex() == 3


def test_loading_a_snapshot_cuts_the_log_at_its_anchor_in_one_rewrite(tmp_path: Path) -> None:
    # pysyncobj loads a dump as clear(), add(previous), add(last): the entries after
    # a matching last entry survive, and nothing is written until the second anchor.
    j = glue.open_journal(str(tmp_path))
    for i in range(1, 9):
        j.add(f"c{i}".encode(), i, 1)
    j.sync()
    j.clear()
    assert len(j) == 8  # not cleared (a crash here keeps the whole log)
    j.add(b"\x01", 4, 1)
    assert len(j) == 8
    j.add(b"\x01", 5, 1)
    assert [j[i][1] for i in range(len(j))] == [4, 5, 6, 7, 8]
    j._destroy()
    again = glue.open_journal(str(tmp_path))
    assert [again[i] for i in range(len(again))] == [
        (b"\x01", 4, 1),
        (b"\x01", 5, 1),
        (b"c6", 6, 1),
        (b"c7", 7, 1),
        (b"c8", 8, 1),
    ]
    again._destroy()


def test_a_pysyncobj_journal_is_migrated_then_set_aside(tmp_path: Path) -> None:
    old = createJournal(str(tmp_path / glue.LEGACY_LOG_FILE))
    for i in range(1, 6):
        old.add(f"cmd{i}".encode(), i, 1 + i // 3)
    old.setCurrentTerm(7, "127.0.0.1:7003")
    old.setRaftCommitIndex(4)
    old.onOneSecondTimer()
    old._destroy()
    j = glue.open_journal(str(tmp_path))
    assert [j[i] for i in range(len(j))] == [
        (f"cmd{i}".encode(), i, 1 + i // 3) for i in range(1, 6)
    ]
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (
        7,
        "127.0.0.1:7003",
        4,
    )
    j._destroy()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert glue.LEGACY_LOG_FILE not in names and "journal.bin.migrated" in names
    again = glue.open_journal(str(tmp_path))  # a second start does not migrate again
    assert len(again) == 5
    again._destroy()


class _CrashBeforeRename:
    """A Syncer whose file sync dies: what a power cut before the rename leaves behind."""

    def file(self, fd: int) -> None:
        raise OSError(5, "power cut")

    def directory(self, path: str) -> None:
        fsync_dir(path)


def _table(blocks: int) -> Table:
    t = Table()
    must_register(t, "n1", lease_ms=600_000)
    must_publish(t, "n1", chain(blocks))
    return t


def test_a_snapshot_interrupted_before_its_rename_leaves_the_previous_one(tmp_path: Path) -> None:
    path = str(tmp_path / "snapshot.bin")
    anchors = [(b"\x01", 5, 1), (b"\x01", 4, 1)]
    snapshot.write(snapshot.capture(_table(3)), path, {"cluster": []}, anchors)
    crash = _CrashBeforeRename()
    with pytest.raises(OSError, match="power cut"):
        snapshot.write(
            snapshot.capture(_table(9)),
            path,
            {"cluster": []},
            anchors,
            Syncer(crash.file, crash.directory),
        )
    table, _, _ = snapshot.read(path)
    assert table.entries == 3  # the old snapshot, whole
    snapshot.write(snapshot.capture(_table(9)), path, {"cluster": []}, anchors)
    assert snapshot.read(path)[0].entries == 9  # the stale temp file does not get in the way


def test_a_compaction_rewrite_interrupted_before_its_rename_keeps_the_whole_log(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "log")
    j = LogFile(path)
    for i in range(1, 11):
        j.append(b"x" * 20, i, 1)
    j.sync()
    crash = _CrashBeforeRename()
    j.syncer = Syncer(crash.file, crash.directory)
    with pytest.raises(OSError, match="power cut"):
        j.drop_before(6)
    assert [e[1] for e in LogFile(path).entries] == list(range(1, 11))
    assert os.path.exists(path + ".kvdir-tmp")


# ------------------------------------------------------------- the ack gate


def test_success_answers_wait_for_one_sync_and_keep_their_order(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    sent: list[tuple[str, dict[str, object]]] = []
    gate = AckGate(j, lambda node, reply: sent.append((node, reply)))
    j.add(b"a", 1, 1)
    assert gate.hold("leader", {"nextNodeIdx": 2, "success": True})
    j.add(b"b", 2, 1)
    assert gate.hold("leader", {"nextNodeIdx": 3, "success": True})
    assert not sent and j.unsynced
    syncs = j.stats.syncs
    assert gate.release() == 2
    assert j.stats.syncs == syncs + 1 and not j.unsynced  # one fdatasync for both
    assert [r["nextNodeIdx"] for _, r in sent] == [2, 3]


def test_a_rejection_goes_out_after_what_was_held(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    sent: list[dict[str, object]] = []
    gate = AckGate(j, lambda node, reply: sent.append(reply))
    j.add(b"a", 1, 1)
    assert gate.hold("leader", {"nextNodeIdx": 2, "success": True})
    assert not gate.hold("leader", {"nextNodeIdx": 2, "success": False, "reset": True})
    assert sent == [{"nextNodeIdx": 2, "success": True}] and not j.unsynced
    # nothing staged: a success answer needs no wait
    assert not gate.hold("leader", {"nextNodeIdx": 2, "success": True})


def test_answers_held_when_the_tail_is_cut_are_dropped(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    sent: list[dict[str, object]] = []
    gate = AckGate(j, lambda node, reply: sent.append(reply))
    j.add(b"a", 1, 1)
    j.add(b"b", 2, 1)
    assert gate.hold("old-leader", {"nextNodeIdx": 3, "success": True})
    assert gate.discard() == 1
    j.deleteEntriesFrom(1)  # a new leader's entry 2 conflicts
    j.add(b"c", 2, 2)
    gate.release()
    assert sent == []  # "I hold entry 2 of term 1" was never sent


def test_a_leader_commit_index_waits_for_its_own_journal(tmp_path: Path) -> None:
    j = glue.open_journal(str(tmp_path))
    j.add(b"a", 1, 1)
    j.add(b"b", 2, 1)
    j.setRaftCommitIndex(2)  # a follower: the leader decided, nothing to wait for
    assert j.unsynced
    j.commit_waits_for_sync = lambda: True  # now it leads
    j.setRaftCommitIndex(2)
    assert not j.unsynced and j.getRaftCommitIndex() == 2


def test_a_failed_write_reaches_the_failure_hook_before_the_error(tmp_path: Path) -> None:
    seen: list[BaseException] = []
    j = glue.open_journal(str(tmp_path))
    j.on_failure = seen.append
    j.add(b"a", 1, 1)
    j.log.syncer = Syncer(_CrashBeforeRename().file, fsync_dir)
    with pytest.raises(OSError, match="power cut"):
        j.sync()
    with pytest.raises(JournalFailed):
        j.add(b"b", 2, 1)
    assert len(seen) == 2
