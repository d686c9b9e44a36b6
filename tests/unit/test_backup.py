"""Backup files, restore, offline recovery, and the membership helpers (no processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import pickle as pysyncobj_pickle
from pysyncobj.journal import createJournal
from pysyncobj.node import TCPNode

from kvdir.directory import backup, codec, snapshot
from kvdir.directory.admin import quorum_ok
from kvdir.directory.consensus import pysyncobj_log
from kvdir.directory.consensus.membership import (
    DataDirBusy,
    MembershipError,
    hello,
    lock_data_dir,
    parse_raft_address,
    read_cluster_id,
    resolve_cluster_id,
    split_hello,
)
from kvdir.directory.consensus.port import LogError
from kvdir.directory.consensus.pysyncobj_journal import LOG_FILE, open_journal
from kvdir.directory.table import Table
from tests.unit.helpers import chain, must_publish, must_register, publish_cmd, view

MEMBERS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


def sample_table(blocks: int = 50) -> Table:
    t = Table()
    must_register(t, "n1", lease_ms=600_000)
    must_publish(t, "n1", chain(blocks))
    return t


def backup_file(tmp_path: Path, t: Table, index: int = 41) -> str:
    body = backup.snapshot_bytes(snapshot.capture(t), MEMBERS, index)
    header = backup.make_header(
        body,
        kind="backup",
        source_replica="r2",
        source_cluster_id="",
        term=7,
        index=index,
        entries=t.entries,
        members=MEMBERS,
        now_ms=1,
    )
    path = str(tmp_path / "b.kvdb")
    backup.write_backup(path, header, body)
    return path


def test_backup_round_trip(tmp_path: Path) -> None:
    t = sample_table()
    header, body = backup.load_backup(backup_file(tmp_path, t))
    assert (header.kind, header.term, header.index, header.entries) == ("backup", 7, 41, 50)
    assert header.members == MEMBERS and header.snapshot_bytes == len(body)
    assert view(backup.table_of(body), chain(50)) == view(t, chain(50))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b"X" + b[1:], "bad magic"),
        (lambda b: b[:-5], "truncated"),
        (lambda b: b + b"!", "bytes after"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum mismatch"),
        (lambda b: b.replace(b'"format":1', b'"format":9', 1), "format 9"),
    ],
    ids=["magic", "truncated", "trailing", "checksum", "version"],
)
def test_damaged_backups_are_refused(tmp_path: Path, damage: object, message: str) -> None:
    path = backup_file(tmp_path, sample_table())
    raw = Path(path).read_bytes()
    Path(path).write_bytes(damage(raw))  # type: ignore[operator]
    with pytest.raises(backup.BackupError, match=message):
        backup.load_backup(path)


def test_restore_prepares_an_empty_dir_once(tmp_path: Path) -> None:
    t = sample_table()
    path = backup_file(tmp_path, t)
    data = tmp_path / "data"
    out = backup.restore(path, str(data), ["127.0.0.1:9001", "127.0.0.1:9002"])
    header, _ = backup.load_backup(path)
    assert out.cluster_id == header.new_cluster_id() == read_cluster_id(str(data))
    table, raft, entries = snapshot.read(str(data / "snapshot.bin"))
    assert raft["cluster"] == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert [(i, term) for _, i, term in entries] == [(41, 1), (40, 1)]
    assert view(table, chain(50)) == view(t, chain(50))
    with pytest.raises(backup.BackupError, match="already holds raft data"):
        backup.restore(path, str(data))
    with pytest.raises(MembershipError):
        backup.restore(path, str(tmp_path / "other"), ["nonsense"])


def _regular(cmd: object) -> bytes:
    """A log entry exactly as pysyncobj writes one for `_apply_blob(blob)`."""
    envelope: bytes = pysyncobj_pickle.dumps((0, (codec.encode(cmd),)))  # type: ignore[arg-type]
    return b"\x00" + envelope


def _journal_of(kind: str, data: Path) -> tuple[Any, Path]:
    """A journal to fill as pysyncobj would, and the file it writes."""
    if kind == "pysyncobj":  # a data dir written before kvdir kept its own journal
        return createJournal(str(data / "journal.bin")), data / "journal.bin"
    return open_journal(str(data)), data / LOG_FILE


@pytest.mark.parametrize("kind", ["kvdir", "pysyncobj"])
def test_recover_replays_snapshot_then_the_whole_journal(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    expected = sample_table(10)
    snapshot.write(
        snapshot.capture(expected), str(data / "snapshot.bin"), {"cluster": MEMBERS}, [
            (b"\x01", 5, 2), (b"\x01", 4, 2)
        ]
    )  # fmt: skip
    journal, journal_file = _journal_of(kind, data)
    journal.add(b"\x01", 4, 2)
    journal.add(b"\x01", 5, 2)  # the snapshot's anchors: skipped
    more = publish_cmd("n1", chain(5, start=10))
    journal.add(_regular(more), 6, 3)
    member = b"\x02" + pysyncobj_pickle.dumps(["add", "127.0.0.1:7004", TCPNode("127.0.0.1:7004")])
    journal.add(member, 7, 3)
    last = publish_cmd("n1", chain(5, start=15))
    journal.add(_regular(last), 8, 3)
    journal.setRaftCommitIndex(6)  # entries 7 and 8 were never seen committed here
    journal.onOneSecondTimer()
    journal._destroy()
    expected.apply(more)
    expected.apply(last)

    state = backup.recover_state(str(data))
    assert (state.index, state.term, state.snapshot_index) == (8, 3, 5)
    assert (state.replayed, state.commit_index) == (3, 6)
    assert view(state.table, chain(20)) == view(expected, chain(20))

    out = str(tmp_path / "rec.kvdb")
    header, _ = backup.recover(str(data), MEMBERS[:1], out, "r1")
    assert (header.kind, header.index, header.term, header.entries) == ("recovery", 9, 3, 20)
    assert journal_file.exists()  # recover itself changes nothing in place


def test_recover_refuses_foreign_journal_entries(tmp_path: Path) -> None:
    evil = b"\x00" + pysyncobj_pickle.dumps((0, (os.getcwd,)))
    with pytest.raises(LogError, match="not a kvdir command"):
        pysyncobj_log.command_of(evil)
    journal = createJournal(str(tmp_path / "journal.bin"))
    journal.add(evil, 1, 1)
    journal._destroy()
    with pytest.raises(backup.BackupError, match="not a kvdir command"):
        backup.recover_state(str(tmp_path))
    (tmp_path / "journal.bin").unlink()
    with pytest.raises(backup.BackupError, match=r"no snapshot\.bin and no journal"):
        backup.recover_state(str(tmp_path))


def test_raft_addresses() -> None:
    assert parse_raft_address(" 10.0.0.1:7001 ") == "10.0.0.1:7001"
    assert parse_raft_address("kvdir-directory-3.kvdir:07001") == "kvdir-directory-3.kvdir:7001"
    for bad in ("", "host", ":7001", "host:0", "host:70000", "ho st:1", "a#b:1", "h:x"):
        with pytest.raises(MembershipError):
            parse_raft_address(bad)


def test_cluster_id_is_adopted_once_and_then_enforced(tmp_path: Path) -> None:
    d = str(tmp_path / "d")
    assert resolve_cluster_id(d, "") == "" and read_cluster_id(d) is None
    assert resolve_cluster_id(d, "c1") == "c1" and read_cluster_id(d) == "c1"
    assert resolve_cluster_id(d, "") == "c1"
    with pytest.raises(MembershipError, match="belongs to cluster 'c1'"):
        resolve_cluster_id(d, "c2")
    with pytest.raises(MembershipError):
        resolve_cluster_id(str(tmp_path / "e"), "bad id!")


def test_a_data_dir_is_held_by_one_process_at_a_time(tmp_path: Path) -> None:
    d = str(tmp_path / "d")
    fd = lock_data_dir(d)
    try:
        with pytest.raises(DataDirBusy, match="in use by another process"):
            lock_data_dir(d)
        with pytest.raises(DataDirBusy):
            backup.restore(backup_file(tmp_path, sample_table()), d)
    finally:
        os.close(fd)
    os.close(lock_data_dir(d))


def test_hello_is_the_bare_address_without_a_cluster_id() -> None:
    assert hello("h:1", "") == "h:1" and split_hello("h:1") == ("h:1", "")
    assert split_hello(hello("h:1", "c9")) == ("h:1", "c9")


def test_quorum() -> None:
    assert quorum_ok(3, 4) and not quorum_ok(2, 4) and quorum_ok(2, 3) and not quorum_ok(1, 2)
    assert not quorum_ok(0, 0)
