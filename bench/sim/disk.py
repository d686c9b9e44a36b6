"""A disk that forgets what was never synced: the storage side of the seeded simulator.

The replicas' files are real (under a tmpfs directory); only the syncs are
injected (`kvdir.directory.consensus.sync.Syncer`, the one seam every durable
write goes through). `Disk` records, at each sync, what a real disk would
then hold on stable storage:

- `sync_file(fd)`: the file's bytes, keyed by inode (a rename keeps them);
- `sync_dir(path)`: which name points at which inode in that directory.

`power_loss(dir)` rewrites the directory to that durable image: names that
were never made durable vanish, each durable name gets its inode's synced
bytes, plus - as a torn write - a seeded prefix of what had been appended
after the last sync (an append-only file may keep any prefix of its
unsynced tail, a file rewritten in place keeps only its synced bytes).

Inodes are kept alive by a hard link in a private folder while their bytes
are recorded, so the filesystem cannot hand a recorded inode number to a new
file.
"""

from __future__ import annotations

import os
import random

from kvdir.directory.consensus.sync import Syncer

KEEP_DIR = ".sim-keep"
"""Per data dir: hard links that pin recorded inodes (never read by a replica)."""


class Disk:
    """The durable image of one replica's data dir (see the module docstring)."""

    def __init__(self, data_dir: str, lies: bool = False) -> None:
        self.lies = lies
        """Record no sync (for tests that the checks catch a disk that loses writes)."""
        self.dir = os.path.abspath(data_dir)
        self.keep = os.path.join(self.dir, KEEP_DIR)
        os.makedirs(self.keep, exist_ok=True)
        self.data: dict[int, bytes] = {}
        """Inode -> its bytes at its last sync."""
        self.names: dict[str, int] = {}
        """Name -> inode, as of the last sync of the directory."""
        self.syncs = 0
        self.syncer = Syncer(file=self.sync_file, directory=self.sync_dir)

    def sync_file(self, fd: int) -> None:
        self.syncs += 1
        if self.lies:
            return
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")  # fds may be write-only: read by name
        if st.st_ino not in self.data:
            pin = os.path.join(self.keep, str(st.st_ino))
            if not os.path.exists(pin):
                os.link(path, pin, follow_symlinks=False)
        with open(path, "rb") as f:
            self.data[st.st_ino] = f.read()

    def sync_dir(self, path: str) -> None:
        self.syncs += 1
        if self.lies or os.path.abspath(path) != self.dir:
            return  # the only directory a replica writes to is its data dir
        self.names = self._listing()
        live = set(self.names.values())  # a synced temp file not yet renamed is listed too
        for ino in [i for i in self.data if i not in live]:
            del self.data[ino]  # deleted or replaced: no name can bring it back
            os.unlink(os.path.join(self.keep, str(ino)))

    def _names_now(self) -> list[str]:
        return [n for n in os.listdir(self.dir) if n != KEEP_DIR]

    def _listing(self) -> dict[str, int]:
        return {n: os.stat(os.path.join(self.dir, n)).st_ino for n in self._names_now()}

    def power_loss(self, rng: random.Random) -> list[str]:
        """Rewrite the data dir to what survives a power cut; returns what was lost (names)."""
        lost: list[str] = []
        now = {n: self._read(n) for n in self._names_now()}
        for n in now:
            os.unlink(os.path.join(self.dir, n))
        for ino in list(self.data):
            os.unlink(os.path.join(self.keep, str(ino)))
        survivors: dict[str, bytes] = {}
        for name, ino in sorted(self.names.items()):
            durable = self.data.get(ino, b"")
            current = now.get(name)
            if current is not None and current != durable and current.startswith(durable):
                # an append-only file: some prefix of its unsynced tail may have landed
                durable = current[: rng.randint(len(durable), len(current))]
            survivors[name] = durable
        lost = sorted(set(now) - set(survivors))
        self.data, self.names = {}, {}
        for name, data in survivors.items():
            path = os.path.join(self.dir, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                self.sync_file(fd)
            finally:
                os.close(fd)
        self.sync_dir(self.dir)
        return lost

    def _read(self, name: str) -> bytes:
        with open(os.path.join(self.dir, name), "rb") as f:
            return f.read()


__all__ = ["KEEP_DIR", "Disk"]
