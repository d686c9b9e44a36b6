"""A data dir's Raft files, read offline: the journal, and the anchors of a snapshot.

What `directory.backup` needs from the Raft side of a stopped replica,
without knowing how pysyncobj lays out its entries:

- `read_log(data_dir)`: every entry of the journal as (index, term, kvdir
  command or None for Raft's own entries), and the commit index last saved.
- `anchors(index, term)`: the (last, previous) log entries a snapshot written
  for a fresh data dir carries, so that pysyncobj resumes its log at `index`.
- `DATA_FILES`: the files that mean "this data dir already holds Raft data".

The journal is kvdir's own (`journal.LOG_FILE`, term file `votes.TERM_FILE`);
a data dir not yet started by a version with it still holds pysyncobj's
(``journal.bin`` and its ``.meta``), read here the same way.
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from kvdir.directory import codec, snapshot
from kvdir.directory.commands import Command
from kvdir.directory.consensus.journal import LOG_FILE, JournalCorrupt, read_only
from kvdir.directory.consensus.port import LogError
from kvdir.directory.consensus.votes import TERM_FILE, read_commit_index

NO_OP = b"\x01"  # pysyncobj's _COMMAND_TYPE.NO_OP entry
_REGULAR = 0  # pysyncobj's _COMMAND_TYPE.REGULAR
JOURNAL_FILE = "journal.bin"
DUMP_FILE = "snapshot.bin"
STAGED_DUMP_SUFFIX = ".staged"
"""A compaction's dump, durable, before it is renamed over DUMP_FILE (if newer)."""
META_SUFFIX = ".meta"
DATA_FILES = (DUMP_FILE, LOG_FILE, TERM_FILE, JOURNAL_FILE, JOURNAL_FILE + META_SUFFIX)


@dataclass(frozen=True, slots=True)
class LogEntry:
    index: int
    term: int
    command: Command | None
    """None for Raft's own entries (no-ops, membership changes)."""


def anchors(index: int, term: int) -> list[snapshot.RaftEntry]:
    """pysyncobj's (last, previous) entries for a snapshot at `index` (at least 2)."""
    index = max(index, 2)
    return [(NO_OP, index, term), (NO_OP, index - 1, term)]


class _NoGlobals(pickle.Unpickler):
    """pysyncobj wraps our command bytes in a pickle of (id, (blob,)); nothing else is allowed.

    Its pickles use protocol 2, which spells a bytes object as a call of
    ``_codecs.encode`` (a pure function); any other global is refused.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return codecs.encode
        raise LogError(f"journal entry names {module}.{name}: not a kvdir command")


def command_of(entry: bytes) -> Command | None:
    """The kvdir command a pysyncobj log entry carries, or None for Raft's own entries."""
    if not entry or entry[0] != _REGULAR:
        return None
    try:
        payload = _NoGlobals(io.BytesIO(entry[1:])).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        if isinstance(e, LogError):
            raise
        raise LogError(f"journal entry is not a pysyncobj command: {e}") from e
    args: Any = payload[1] if isinstance(payload, tuple) and len(payload) >= 2 else ()
    if not isinstance(args, tuple) or len(args) != 1 or not isinstance(args[0], bytes):
        raise LogError("journal entry does not carry one kvdir command")
    return codec.decode(args[0])


def read_log(data_dir: str) -> tuple[list[LogEntry], int]:
    """(entries, commit index) of `data_dir`'s journal, read from a copy (never the original)."""
    raw, commit = _journal_entries(data_dir)
    return [LogEntry(i, t, command_of(c)) for c, i, t in raw], commit


def _journal_entries(data_dir: str) -> tuple[list[tuple[bytes, int, int]], int]:
    path = os.path.join(data_dir, LOG_FILE)
    if not os.path.exists(path):
        return _legacy_journal_entries(data_dir)
    try:
        entries = read_only(path)
    except JournalCorrupt as e:
        raise LogError(str(e)) from e
    return entries, read_commit_index(os.path.join(data_dir, TERM_FILE))


def _legacy_journal_entries(data_dir: str) -> tuple[list[tuple[bytes, int, int]], int]:
    from pysyncobj.journal import createJournal

    src = os.path.join(data_dir, JOURNAL_FILE)
    if not os.path.exists(src):
        return [], 0
    with tempfile.TemporaryDirectory(prefix="kvdir-recover-") as d:
        copy = os.path.join(d, JOURNAL_FILE)
        shutil.copyfile(src, copy)
        journal = createJournal(copy)
        try:
            entries = [tuple(journal[i]) for i in range(len(journal))]
        finally:
            journal._destroy()
    return [(bytes(c), int(i), int(t)) for c, i, t in entries], _commit_index(src + META_SUFFIX)


def _commit_index(meta_path: str) -> int:
    """The commit index pysyncobj last saved (about once a second); 0 when unknown."""
    try:
        with open(meta_path, "rb") as f:
            meta = _NoGlobals(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError):
        return 0
    value = meta.get("raftCommitIndex", 0) if isinstance(meta, dict) else 0
    return value if isinstance(value, int) else 0
