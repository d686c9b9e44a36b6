"""Backup files, restore into a data dir, and recovery from a lone survivor.

A backup file is ``MAGIC``, a u32 header length, a JSON header, then the body:
a snapshot in `directory.snapshot`'s format. The header says what the body
is: ``format``, ``kind`` (backup or recovery), where it came from (replica,
cluster id, Raft ``term`` and ``index`` of the last entry the table
includes), ``entries``, the Raft ``members`` then, the body's size and its
``sha256``. Readers check all of it before anything is written.

- `write_backup` / `read_backup`: the file, verified.
- `restore`: turn a backup into a data dir a replica starts from. Every member
  of the new cluster is restored from the *same* file: they then share one
  log anchor (two no-op entries at the backup's index, term 1), so none of
  them can win an election with an empty log and truncate the others. The
  new cluster gets a cluster id derived from the file (the same on every
  member, different from the old cluster's), which fences off old members.
- `recover`: rebuild the state of a stopped replica offline from its own
  snapshot and journal - every entry in its log, committed or not (an entry
  the survivor holds but had not yet seen committed may have been
  acknowledged to a client) - and write it as a backup file of kind
  ``recovery`` for `restore`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from kvdir.directory import consensus, snapshot
from kvdir.directory.consensus.membership import (
    lock_data_dir,
    parse_raft_address,
    read_cluster_id,
    write_cluster_id,
)
from kvdir.directory.consensus.port import LogError
from kvdir.directory.consensus.sync import replace_durably
from kvdir.directory.table import Table

MAGIC = b"KVDBACK\x00"
FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20
HEADER_BYTES_MAX = 1 << 20
ANCHOR_TERM = 1
"""Term of a restored cluster's first entries: its first election is term 1."""


class BackupError(ValueError):
    """Not a usable backup, or a data dir that cannot take one; says why."""


@dataclass(frozen=True, slots=True)
class Header:
    kind: str
    created_unix_ms: int
    source_replica: str
    source_cluster_id: str
    term: int
    index: int
    entries: int
    members: list[str]
    snapshot_bytes: int
    sha256: str

    def to_json(self) -> bytes:
        d = {"format": FORMAT_VERSION, **{k: getattr(self, k) for k in self.__slots__}}
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    def new_cluster_id(self) -> str:
        """The id a cluster restored from this file runs with (same on every member)."""
        return f"r{self.index}-{self.sha256[:12]}"


# ------------------------------------------------------------------ the file


def snapshot_bytes(
    image: snapshot.Image, members: list[str], index: int, tmp_dir: str | None = None
) -> bytes:
    """The body: `image` as a snapshot anchored at `index` (staged under `tmp_dir`)."""
    with tempfile.TemporaryDirectory(prefix="kvdir-backup-", dir=tmp_dir) as d:
        path = os.path.join(d, "snapshot.bin")
        snapshot.write(image, path, {"cluster": sorted(members)}, anchors(index))
        with open(path, "rb") as f:
            return f.read()


def anchors(index: int) -> list[snapshot.RaftEntry]:
    """The Raft log anchors of a restored snapshot at `index` (term ANCHOR_TERM)."""
    return consensus.anchors(index, ANCHOR_TERM)


def make_header(
    body: bytes,
    *,
    kind: str,
    source_replica: str,
    source_cluster_id: str,
    term: int,
    index: int,
    entries: int,
    members: list[str],
    now_ms: int | None = None,
) -> Header:
    return Header(
        kind=kind,
        created_unix_ms=time.time_ns() // 1_000_000 if now_ms is None else now_ms,
        source_replica=source_replica,
        source_cluster_id=source_cluster_id,
        term=term,
        index=index,
        entries=entries,
        members=sorted(members),
        snapshot_bytes=len(body),
        sha256=hashlib.sha256(body).hexdigest(),
    )


def encode(header: Header, body: bytes) -> Iterator[bytes]:
    """The file's bytes, in chunks of at most CHUNK_BYTES."""
    head = header.to_json()
    yield MAGIC + struct.pack("<I", len(head)) + head
    view = memoryview(body)
    for i in range(0, len(body), CHUNK_BYTES):
        yield bytes(view[i : i + CHUNK_BYTES])


def write_backup(path: str, header: Header, body: bytes) -> None:
    """Write atomically (a temp file, fsync, rename, fsync of the directory)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        for chunk in encode(header, body):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    replace_durably(tmp, path)


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BackupError(f"backup is truncated ({what})")
    return data


def parse_header(raw: bytes) -> Header:
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise BackupError(f"backup header is not JSON: {e}") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT_VERSION:
        fmt = d.get("format") if isinstance(d, dict) else None
        raise BackupError(f"backup format {fmt!r} is not supported (expected {FORMAT_VERSION})")
    d.pop("format")
    try:
        return Header(**d)
    except TypeError as e:
        raise BackupError(f"backup header is incomplete: {e}") from e


def read_backup(f: BinaryIO) -> tuple[Header, bytes]:
    """Header and verified body of a backup file; raises BackupError."""
    if f.read(len(MAGIC)) != MAGIC:
        raise BackupError("not a kvdir backup file (bad magic)")
    (hlen,) = struct.unpack("<I", _read_exact(f, 4, "header length"))
    if hlen > HEADER_BYTES_MAX:
        raise BackupError(f"backup header of {hlen} bytes is over the limit")
    header = parse_header(_read_exact(f, hlen, "header"))
    body = _read_exact(f, header.snapshot_bytes, "snapshot")
    if f.read(1):
        raise BackupError("backup has bytes after the snapshot")
    digest = hashlib.sha256(body).hexdigest()
    if digest != header.sha256:
        raise BackupError(f"backup checksum mismatch (sha256 {digest}, header {header.sha256})")
    return header, body


def load_backup(path: str) -> tuple[Header, bytes]:
    try:
        with open(path, "rb") as f:
            return read_backup(f)
    except OSError as e:
        raise BackupError(f"cannot read {path}: {e.strerror}") from e


def table_of(body: bytes) -> Table:
    """The table a verified body holds."""
    with tempfile.TemporaryDirectory(prefix="kvdir-restore-") as d:
        path = os.path.join(d, "snapshot.bin")
        with open(path, "wb") as f:
            f.write(body)
        try:
            table, _, _ = snapshot.read(path)
        except (snapshot.SnapshotError, KeyError, ValueError) as e:
            raise BackupError(f"backup snapshot is unreadable: {e}") from e
    return table


# --------------------------------------------------------------- restore


_DATA_FILES = consensus.DATA_FILES


def _has_data(data_dir: str) -> list[str]:
    return [n for n in _DATA_FILES if os.path.exists(os.path.join(data_dir, n))]


@dataclass(frozen=True, slots=True)
class Restored:
    cluster_id: str
    members: list[str]
    index: int
    entries: int


def restore(
    path: str, data_dir: str, members: list[str] | None = None, cluster_id: str = ""
) -> Restored:
    """Make `data_dir` (which must hold no Raft data) start from the backup at `path`."""
    header, body = load_backup(path)
    table = table_of(body)
    chosen = sorted({parse_raft_address(m) for m in (members or header.members)})
    if not chosen:
        raise BackupError("no members: give --members RAFT_HOST:PORT,...")
    lock = lock_data_dir(data_dir)
    try:
        return _restore_locked(header, body, table, chosen, data_dir, cluster_id)
    finally:
        os.close(lock)


def _restore_locked(
    header: Header, body: bytes, table: Table, chosen: list[str], data_dir: str, cluster_id: str
) -> Restored:
    present = _has_data(data_dir)
    if present:
        raise BackupError(
            f"{data_dir} already holds raft data ({', '.join(present)}); "
            "restore only into an empty data dir"
        )
    os.makedirs(data_dir, exist_ok=True)
    cid = cluster_id or header.new_cluster_id()
    snapshot.write(
        snapshot.capture(table),
        os.path.join(data_dir, "snapshot.bin"),
        {"cluster": chosen},
        anchors(header.index),
    )
    write_cluster_id(data_dir, cid)
    return Restored(cid, chosen, max(header.index, 2), table.entries)


# -------------------------------------------------------------- recovery


@dataclass(frozen=True, slots=True)
class Recovered:
    table: Table
    index: int
    term: int
    snapshot_index: int
    replayed: int
    """Log entries after the snapshot that were applied (kvdir commands and Raft no-ops)."""
    commit_index: int
    """The survivor's commit index when it stopped; entries past it were replayed too."""


def recover_state(data_dir: str) -> Recovered:
    """The table a stopped replica's snapshot plus its whole journal describe."""
    snap = os.path.join(data_dir, "snapshot.bin")
    if os.path.exists(snap):
        try:
            table, _, snap_entries = snapshot.read(snap)
        except snapshot.SnapshotError as e:
            raise BackupError(f"{snap}: {e}") from e
        index, term = snap_entries[0][1], snap_entries[0][2]
    else:
        table, index, term = Table(), 0, 0
    snapshot_index = index
    try:
        entries, commit = consensus.read_log(data_dir)
    except LogError as e:
        raise BackupError(str(e)) from e
    if not entries and not os.path.exists(snap):
        raise BackupError(f"{data_dir} holds no snapshot.bin and no journal")
    replayed = 0
    for entry in entries:
        if entry.index <= index:
            continue
        if entry.index != index + 1:
            raise BackupError(f"journal skips from index {index} to {entry.index}")
        if entry.command is not None:
            table.apply(entry.command)
        index, term = entry.index, entry.term
        replayed += 1
    return Recovered(table, index, term, snapshot_index, replayed, commit)


def recover(
    data_dir: str, new_members: list[str], out: str, source_replica: str = ""
) -> tuple[Header, Recovered]:
    """Write the survivor's whole state as a backup file of kind ``recovery``."""
    members = sorted({parse_raft_address(m) for m in new_members})
    if not members:
        raise BackupError("give --new-members RAFT_HOST:PORT,...")
    state = recover_state(data_dir)
    # A new term space starts at ANCHOR_TERM; the index moves on past everything replayed.
    body = snapshot_bytes(snapshot.capture(state.table), members, state.index + 1)
    header = make_header(
        body,
        kind="recovery",
        source_replica=source_replica,
        source_cluster_id=read_cluster_id(data_dir) or "",
        term=state.term,
        index=state.index + 1,
        entries=state.table.entries,
        members=members,
    )
    write_backup(out, header, body)
    return header, state


def recover_in_place(
    data_dir: str, new_members: list[str], out: str, source_replica: str = ""
) -> tuple[Header, Recovered, str, Restored]:
    """`recover`, set the old files aside, restore `out` into `data_dir`: all under its lock."""
    lock = lock_data_dir(data_dir)
    try:
        header, state = recover(data_dir, new_members, out, source_replica)
        aside = set_aside(data_dir)
        _, body = load_backup(out)
        restored = _restore_locked(header, body, state.table, header.members, data_dir, "")
    finally:
        os.close(lock)
    return header, state, aside, restored


def set_aside(data_dir: str, now: float | None = None) -> str:
    """Move a data dir's Raft files into a dated subfolder (recovery never deletes)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    dest = os.path.join(data_dir, f"pre-recovery-{stamp}")
    os.makedirs(dest, exist_ok=False)
    for name in (*_DATA_FILES, "cluster-id"):
        src = os.path.join(data_dir, name)
        if os.path.exists(src):
            os.replace(src, os.path.join(dest, name))
    return dest
