"""`snapshot.index_of` reads a dump's last log index without loading its table.

A follower uses it to refuse a snapshot from the leader that is no newer than
its own dump (`DurableSyncObj._snapshot_chunk`), so it must agree with what a
full load reports, and fail on a file that is not a whole snapshot.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdir.directory import snapshot
from kvdir.directory.commands import Publish, RegisterNode, Tier
from kvdir.directory.table import Table


def _table() -> Table:
    t = Table()
    t.apply(RegisterNode("n1", "h", "e", ("tcp",), 1, 10_000, 0))
    hashes = [bytes([i]) * 8 for i in range(20)]
    n = len(hashes)
    t.apply(
        Publish("n1", 1, "ns", int(Tier.GPU), hashes, list(range(n)), [4096] * n, [7] * n, [1] * n)
    )
    return t


def test_the_index_is_the_newest_raft_entry_a_full_load_reports(tmp_path: Path) -> None:
    path = str(tmp_path / "dump")
    entries = [(b"last command", 42, 3), (b"x" * 300, 41, 3)]
    snapshot.write(snapshot.capture(_table()), path, {"cluster": ["a:1"]}, entries)
    assert snapshot.index_of(path) == 42
    _, _, loaded = snapshot.read(path)
    assert max(idx for _, idx, _ in loaded) == 42


def test_a_truncated_snapshot_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dump"
    snapshot.write(snapshot.capture(_table()), str(path), {}, [(b"c", 9, 1), (b"d", 8, 1)])
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])
    with pytest.raises(snapshot.SnapshotError):
        snapshot.index_of(str(path))
    path.write_bytes(b"not a snapshot at all")
    with pytest.raises(snapshot.SnapshotError):
        snapshot.index_of(str(path))
