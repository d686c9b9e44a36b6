"""The kvdir Raft journal on real files: group commit, torn tails, corruption, votes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdir.directory.consensus import records
from kvdir.directory.consensus.journal import JournalCorrupt, JournalFailed, LogFile
from kvdir.directory.consensus.sync import Durability, Syncer, fsync_dir
from kvdir.directory.consensus.votes import SLOT_BYTES, TermFileCorrupt, TermStore


class Counting:
    """A Syncer that really syncs and counts (or fails, once `fail` is set)."""

    def __init__(self) -> None:
        self.files = 0
        self.dirs = 0
        self.fail = False

    def file(self, fd: int) -> None:
        if self.fail:
            raise OSError(5, "injected EIO")
        self.files += 1
        os.fdatasync(fd)

    def directory(self, path: str) -> None:
        self.dirs += 1
        fsync_dir(path)

    def syncer(self) -> Syncer:
        return Syncer(self.file, self.directory)


def cmd(i: int, size: int = 40) -> bytes:
    return (f"entry-{i}:".encode() * size)[:size]


def fill(path: Path, batches: list[int], start: int = 1, term: int = 1) -> LogFile:
    """A journal whose entries were appended and synced in `batches` (sizes)."""
    j = LogFile(str(path))
    i = start
    for n in batches:
        for _ in range(n):
            j.append(cmd(i), i, term)
            i += 1
        j.sync()
    return j


def test_entries_survive_a_reopen_and_appends_continue(tmp_path: Path) -> None:
    path = tmp_path / "log"
    fill(path, [3, 2]).close()
    j = LogFile(str(path))
    assert [e[1] for e in j.entries] == [1, 2, 3, 4, 5]
    assert j.entries[2] == (cmd(3), 3, 1)
    j.append(cmd(6), 6, 2)
    j.close()
    assert LogFile(str(path)).entries[-1] == (cmd(6), 6, 2)


def test_one_fdatasync_serves_a_whole_batch(tmp_path: Path) -> None:
    c = Counting()
    j = LogFile(str(tmp_path / "log"), syncer=c.syncer())
    created = c.files
    for i in range(1, 101):
        j.append(cmd(i), i, 1)
    assert j.unsynced and c.files == created
    assert j.sync() == 100
    assert c.files == created + 1 and not j.unsynced
    assert j.sync() == 0 and c.files == created + 1  # nothing staged: no sync
    assert j.stats.syncs == 1 and j.stats.largest_batch == 100 and j.stats.batch_sizes == {128: 1}


def test_process_crash_mode_writes_without_syncing_until_the_second_timer(tmp_path: Path) -> None:
    c = Counting()
    path = tmp_path / "log"
    j = LogFile(str(path), Durability.PROCESS_CRASH, c.syncer())
    created = c.files
    j.append(cmd(1), 1, 1)
    assert j.sync() == 1 and c.files == created
    assert len(path.read_bytes()) > records.HEADER_BYTES  # the kernel has it
    j.sync_every_second()
    assert c.files == created + 1
    j.sync_every_second()
    assert c.files == created + 1  # nothing new


def last_record_start(j: LogFile) -> int:
    return j._offsets[-1]


@pytest.mark.parametrize("batches", [[5, 1], [5, 3]])
def test_a_torn_last_record_is_cut_at_every_byte_offset(tmp_path: Path, batches: list[int]) -> None:
    src = tmp_path / "log"
    j = fill(src, batches)
    start, full = last_record_start(j), src.stat().st_size
    j.close()
    data = src.read_bytes()
    kept = sum(batches) - 1
    for cut in range(start, full):
        torn = tmp_path / f"torn-{cut}"
        torn.write_bytes(data[:cut])
        t = LogFile(str(torn))
        assert len(t.entries) == kept, cut
        assert torn.stat().st_size == start, cut  # the partial record is gone from the file
        t.append(cmd(kept + 1), kept + 1, 1)
        t.close()
        assert len(LogFile(str(torn)).entries) == kept + 1
        torn.unlink()


def test_garbage_over_the_unsynced_tail_is_cut_even_with_intact_records_after_it(
    tmp_path: Path,
) -> None:
    """Pages of a batch reach the disk in any order: a hole may precede intact records."""
    path = tmp_path / "log"
    j = fill(path, [4])
    for i in range(5, 9):  # one batch of 4 written but not synced when the power went
        j.append(cmd(i), i, 1)
    j._write_staged()
    hole = j._offsets[5]  # entry 6: garbled; entries 7 and 8 intact after it
    os.close(j._fd)
    data = bytearray(path.read_bytes())
    data[hole : hole + 30] = b"\0" * 30
    path.write_bytes(bytes(data))
    t = LogFile(str(path))
    assert [e[1] for e in t.entries] == [1, 2, 3, 4, 5]
    assert path.stat().st_size == hole


def test_a_flipped_bit_in_a_synced_record_stops_the_replica(tmp_path: Path) -> None:
    path = tmp_path / "log"
    j = fill(path, [3, 3, 3, 3])
    victim_start, victim_end = j._offsets[4], j._offsets[5]
    j.close()
    good = path.read_bytes()
    for pos in range(victim_start, victim_end):
        for bit in (0, 7):
            bad = bytearray(good)
            bad[pos] ^= 1 << bit
            path.write_bytes(bytes(bad))
            with pytest.raises(JournalCorrupt) as e:
                LogFile(str(path))
            line = str(e.value)
            assert "\n" not in line and f"byte {victim_start}" in line, (pos, bit)
            assert "kvdir directory recover" in line
            assert path.read_bytes() == bytes(bad)  # never cut, never rewritten


def test_a_damaged_file_header_stops_the_replica(tmp_path: Path) -> None:
    path = tmp_path / "log"
    fill(path, [2]).close()
    data = bytearray(path.read_bytes())
    data[3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="not a kvdir journal header"):
        LogFile(str(path))


def test_a_failed_fdatasync_poisons_the_journal(tmp_path: Path) -> None:
    """After EIO the kernel may have dropped the pages: nothing may be acknowledged again."""
    c = Counting()
    j = LogFile(str(tmp_path / "log"), syncer=c.syncer())
    j.append(cmd(1), 1, 1)
    c.fail = True
    with pytest.raises(OSError, match="injected EIO"):
        j.sync()
    c.fail = False
    with pytest.raises(JournalFailed):
        j.sync()
    with pytest.raises(JournalFailed):
        j.append(cmd(2), 2, 1)


def test_truncate_from_is_durable_and_later_appends_follow_the_cut(tmp_path: Path) -> None:
    c = Counting()
    path = tmp_path / "log"
    j = LogFile(str(path), syncer=c.syncer())
    for i in range(1, 7):
        j.append(cmd(i), i, 1)
    j.sync()
    before = c.files
    j.truncate_from(3)  # keep entries 1..3: a new leader's conflicting tail follows
    assert c.files == before + 1
    j.append(cmd(40), 4, 2)
    j.sync()
    j.close()
    assert LogFile(str(path)).entries == [
        (cmd(1), 1, 1),
        (cmd(2), 2, 1),
        (cmd(3), 3, 1),
        (cmd(40), 4, 2),
    ]


def test_drop_before_rewrites_the_file_and_offsets_stay_right(tmp_path: Path) -> None:
    path = tmp_path / "log"
    j = fill(path, [10])
    j.append(cmd(11), 11, 1)  # staged, not synced: must survive the rewrite too
    j.drop_before(7)
    assert [e[1] for e in j.entries] == [8, 9, 10, 11]
    j.truncate_from(2)  # uses the rewritten offsets
    j.append(cmd(12), 10, 3)
    j.close()
    assert [(e[1], e[2]) for e in LogFile(str(path)).entries] == [(8, 1), (9, 1), (10, 3)]
    assert not any(p.name.endswith("kvdir-tmp") for p in tmp_path.iterdir())


def test_clear_leaves_an_empty_journal(tmp_path: Path) -> None:
    path = tmp_path / "log"
    j = fill(path, [3])
    j.clear()
    j.append(cmd(100), 100, 5)
    j.close()
    assert LogFile(str(path)).entries == [(cmd(100), 100, 5)]


def test_reanchor_keeps_the_entries_after_a_matching_last_entry(tmp_path: Path) -> None:
    # A restart between a compaction's dump rename (at 6) and its log trim.
    path = tmp_path / "log"
    j = fill(path, [10])
    j.append(cmd(11), 11, 1)  # staged only: kept and made durable by the rewrite
    assert j.reanchor((b"p", 5, 1), (b"l", 6, 1)) == 5
    assert [(e[0], e[1]) for e in j.entries[:2]] == [(b"p", 5), (b"l", 6)]
    j.truncate_from(4)  # the offsets of the rewritten file are right
    j.append(cmd(9), 9, 2)
    j.close()
    again = LogFile(str(path)).entries
    assert [(e[1], e[2]) for e in again] == [(5, 1), (6, 1), (7, 1), (8, 1), (9, 2)]
    assert again[2] == (cmd(7), 7, 1)


def test_reanchor_drops_a_log_that_does_not_hold_the_last_entry(tmp_path: Path) -> None:
    path = tmp_path / "log"
    j = fill(path, [4], term=1)
    assert j.reanchor((b"p", 3, 2), (b"l", 4, 2)) == 0  # our 4 is term 1: a conflict
    assert [(e[1], e[2]) for e in j.entries] == [(3, 2), (4, 2)]
    assert j.reanchor((b"p", 9, 2), (b"l", 10, 2)) == 0  # past our end
    j.close()
    assert [(e[1], e[2]) for e in LogFile(str(path)).entries] == [(9, 2), (10, 2)]


def test_out_of_order_appends_are_a_programming_error(tmp_path: Path) -> None:
    j = fill(tmp_path / "log", [2])
    with pytest.raises(AssertionError):
        j.append(cmd(9), 9, 1)


def test_wait_durable_syncs_only_when_the_entry_is_not_yet_durable(tmp_path: Path) -> None:
    c = Counting()
    j = LogFile(str(tmp_path / "log"), syncer=c.syncer())
    for i in range(1, 6):
        j.append(cmd(i), i, 1)
    base = c.files
    j.wait_durable(3)  # the leader's commit barrier: one fdatasync covers all five
    assert c.files == base + 1 and not j.unsynced
    j.wait_durable(5)
    j.wait_durable(0)  # below the log: in a snapshot already
    assert c.files == base + 1


# ---------------------------------------------------------------- term file


def test_term_and_vote_are_synced_before_set_term_returns(tmp_path: Path) -> None:
    c = Counting()
    path = str(tmp_path / "term")
    t = TermStore(path, c.syncer())
    before = c.files
    t.set_term(3, "127.0.0.1:7002")
    assert c.files == before + 1
    t.set_commit(17)
    assert c.files == before + 1  # the commit index waits for flush_commit
    t.flush_commit()
    assert c.files == before + 2
    t.close()
    again = TermStore(path)
    assert (again.term, again.voted_for, again.commit_index) == (3, "127.0.0.1:7002", 17)


def test_a_torn_term_write_leaves_the_previous_vote(tmp_path: Path) -> None:
    path = tmp_path / "term"
    t = TermStore(str(path))
    t.set_term(4, "a:1")
    t.set_term(5, None)  # the write the power cut tears
    t.close()
    data = bytearray(path.read_bytes())
    newest_slot = 0  # seq 2 lives in slot 0
    data[newest_slot * SLOT_BYTES + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    again = TermStore(str(path))
    assert (again.term, again.voted_for) == (4, "a:1")


def test_a_term_file_with_no_intact_slot_stops_the_replica(tmp_path: Path) -> None:
    path = tmp_path / "term"
    TermStore(str(path)).close()
    path.write_bytes(b"\x55" * (2 * SLOT_BYTES))
    with pytest.raises(TermFileCorrupt, match="vote"):
        TermStore(str(path))
