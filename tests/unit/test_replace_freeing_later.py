"""`replace_freeing_later`: the new file in place at once, the old one's blocks freed elsewhere.

Freeing a big file where its last reference drops cost a Raft thread 80 ms per
120 MB (a journal rewrite after a compaction renamed a new log over the old).
The old file is held open across the rename and truncated, then closed, by a
daemon thread; a failed rename must leave the old file whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdir.directory.consensus import sync
from kvdir.local import wait_for


def _file(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def test_the_new_file_replaces_the_old_and_the_old_inode_is_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "FREE_STEP_BYTES", 1000)  # several steps for a small file
    path, tmp = tmp_path / "log", tmp_path / "log.tmp"
    _file(path, b"o" * 10_500)
    _file(tmp, b"new")
    watcher = os.open(path, os.O_RDONLY)  # sees the old inode after the rename
    try:
        sync.replace_freeing_later(str(tmp), str(path))
        assert path.read_bytes() == b"new"
        assert not tmp.exists()
        wait_for(lambda: os.fstat(watcher).st_size == 0, 10.0, "the old file to be emptied")
    finally:
        os.close(watcher)


def test_a_failed_rename_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _file(path, b"o" * 5000)
    with pytest.raises(FileNotFoundError):
        sync.replace_freeing_later(str(tmp_path / "missing"), str(path))
    assert path.read_bytes() == b"o" * 5000


def test_nothing_to_free_when_no_file_was_there(tmp_path: Path) -> None:
    path, tmp = tmp_path / "dump", tmp_path / "dump.tmp"
    _file(tmp, b"first")
    sync.replace_freeing_later(str(tmp), str(path))
    assert path.read_bytes() == b"first"
