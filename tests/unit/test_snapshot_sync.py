"""A dump is synced as it is written, never as one big fsync at its end.

On ext4 (data=ordered) the journal's fdatasync on the Raft thread waits for
every dirty data block allocated in the same filesystem transaction; a whole
dump synced at once held it 230-270 ms at 3M entries (`snapshot.DUMP_SYNC_BYTES`).
The syncer here is the injected seam every durable write goes through: it
records the file's size at each sync instead of calling fdatasync (a unit test
cannot see a disk's writeback).
"""

from __future__ import annotations

import os

import pytest

from kvdir.directory import snapshot
from kvdir.directory.commands import Publish, RegisterNode, Tier
from kvdir.directory.consensus.sync import Syncer
from kvdir.directory.table import Table

EVERY = 4096


class _Sizes:
    """The size of each file at each sync, in order."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.dirs = 0

    def file(self, fd: int) -> None:
        self.sizes.append(os.fstat(fd).st_size)

    def directory(self, path: str) -> None:
        self.dirs += 1


def _table(entries: int) -> Table:
    t = Table()
    t.apply(RegisterNode("n0", "127.0.0.1", "", ("tcp",), 1, 600_000, 0))
    hs = [i.to_bytes(8, "big") for i in range(entries)]
    n = len(hs)
    t.apply(Publish("n0", 1, "ns", int(Tier.GPU), hs, [0] * n, [4096] * n, [7] * n, [1] * n))
    return t


def test_a_dump_is_synced_every_dump_sync_bytes(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "DUMP_SYNC_BYTES", EVERY)
    table = _table(2000)
    rec = _Sizes()
    path = os.path.join(tmp_path, "dump")
    snapshot.write(
        snapshot.capture(table), path, {"cluster": []}, [], Syncer(rec.file, rec.directory)
    )
    total = os.path.getsize(path)
    assert total > 10 * EVERY
    assert rec.sizes[:-1] == [EVERY * (i + 1) for i in range(total // EVERY)]
    assert rec.sizes[-1] == total  # the whole file, before the rename
    assert rec.dirs == 1
    loaded, raft, _ = snapshot.read(path)
    assert loaded.entries == table.entries == 2000
    assert raft == {"cluster": []}


@pytest.mark.parametrize("sizes", [[1], [EVERY - 1, 2], [3 * EVERY + 5], [EVERY, EVERY, 7]])
def test_synced_every_passes_every_byte_through_in_order(
    tmp_path: os.PathLike[str], sizes: list[int]
) -> None:
    rec = _Sizes()
    path = os.path.join(tmp_path, "f")
    chunks = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    with open(path, "wb") as f:
        w = snapshot._SyncedEvery(f, Syncer(rec.file, rec.directory), EVERY)
        for c in chunks:
            assert w.write(memoryview(c)) == len(c)
    with open(path, "rb") as f:
        assert f.read() == b"".join(chunks)
    assert rec.sizes == [EVERY * (i + 1) for i in range(sum(sizes) // EVERY)]
