"""The glue that makes pysyncobj keep its Raft log and vote in kvdir's storage.

pysyncobj builds its log through one factory, `createJournal(path)`, and
uses it through a dozen methods (add, clear, deleteEntriesFrom/To, indexing,
term, vote, commit index, a one-second timer). `install()` replaces the
factory that `pysyncobj.syncobj` calls with one that hands out a journal
opened beforehand for that path (`register`), and falls back to pysyncobj's
own for any other path. `KvdirJournal` translates the methods to `LogFile`
(the entries) and `TermStore` (term, vote, commit index).

What pysyncobj does not know: `add` only stages an entry. The adapter must
call `sync()` before anything acknowledges a staged entry (the follower's
append reply, the leader's commit count); see `directory/raft.py`. And
`clear` does not clear: pysyncobj calls it only to load a snapshot, and the
adapter keeps the entries after the snapshot's anchor (`KvdirJournal._anchor`).

A data dir written by pysyncobj's own journal (``journal.bin`` and its
``.meta``) is migrated on first open: every entry, the term, the vote and
the commit index are copied into the new files, made durable, and only then
are the old files renamed aside.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from kvdir.directory.consensus.journal import LOG_FILE, JournalFailed, LogFile, SyncStats
from kvdir.directory.consensus.pysyncobj_log import JOURNAL_FILE, META_SUFFIX
from kvdir.directory.consensus.records import Entry
from kvdir.directory.consensus.sync import REAL, Durability, Syncer
from kvdir.directory.consensus.votes import TERM_FILE, TermStore

log = logging.getLogger("kvdir.directory.journal")

LEGACY_LOG_FILE = JOURNAL_FILE
"""pysyncobj's FileJournal (mmap, never msync'd); read only to migrate."""
LEGACY_META_FILE = JOURNAL_FILE + META_SUFFIX
MIGRATED_SUFFIX = ".migrated"
STATS_EVERY_S = 10
"""The group-commit counters are logged every this many one-second timers (if they moved)."""

# pysyncobj's Journal interface keeps its camelCase names.
# ruff: noqa: N802, N803


def _reraise(error: BaseException) -> None:
    raise error


class KvdirJournal:
    """pysyncobj's journal interface over a `LogFile` and a `TermStore`.

    `on_failure` runs when a write or sync fails, before the error propagates.
    pysyncobj's tick loop logs and *continues* after an exception, with its
    in-memory term or log already changed, so a replica must not go on: the
    adapter makes this hook end the process (a restart recovers from what is
    on disk). The default re-raises (tests).
    """

    def __init__(
        self,
        log_file: LogFile,
        terms: TermStore,
        on_failure: Callable[[BaseException], None] = _reraise,
    ) -> None:
        self.log = log_file
        self.terms = terms
        self.on_failure = on_failure
        self.commit_waits_for_sync: Callable[[], bool] = lambda: False
        """True while this replica leads: its own copy counts toward a commit, so a
        commit index it sets must not pass what its journal has made durable."""
        self._timers = 0
        self._logged_syncs = 0
        self._anchors: list[Entry] | None = None
        """Between clear() and its two anchors: those seen so far (see `_anchor`)."""

    def _io(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except (OSError, JournalFailed) as e:
            self.on_failure(e)
            raise

    # -- the log
    def add(self, command: bytes, idx: int, term: int) -> None:
        if self._anchors is not None:
            self._anchor(bytes(command), idx, term)
            return
        self._io(lambda: self.log.append(command, idx, term))

    def clear(self) -> None:
        """The first step of loading a snapshot: see `_anchor`."""
        assert self._anchors is None, "clear() twice without its two anchors"
        self._anchors = []

    def _anchor(self, command: bytes, idx: int, term: int) -> None:
        """pysyncobj loads a snapshot as clear(), add(previous), add(last entry).

        Clearing would take every entry after the snapshot with it - entries
        this replica may have acknowledged (a restart between a compaction's
        dump rename and its log trim, or an install from the leader while our
        log runs past the snapshot). So clear() only starts the sequence, and
        the second anchor applies Raft's rule in one durable rewrite
        (`LogFile.reanchor`): the entries after a matching last entry stay.
        """
        assert self._anchors is not None
        self._anchors.append((command, idx, term))
        if len(self._anchors) < 2:
            return
        prev, last = self._anchors
        self._anchors = None
        dropped = sum(1 for e in self.log.entries if e[1] > last[1])
        kept = int(self._io(lambda: self.log.reanchor(prev, last)))
        if kept < dropped:
            log.warning(
                "journal: entries after a snapshot that does not match them were dropped",
                extra={"snapshot_index": last[1], "dropped": dropped - kept},
            )

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        self._io(lambda: self.log.truncate_from(entryFrom))

    def deleteEntriesTo(self, entryTo: int) -> None:
        self._io(lambda: self.log.drop_before(entryTo))

    def __getitem__(self, item: int | slice) -> Any:
        return self.log.entries[item]

    def __len__(self) -> int:
        return len(self.log.entries)

    # -- term, vote, commit index
    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        """Durable before returning: pysyncobj sends the vote or request right after."""
        self._io(lambda: self.terms.set_term(term, votedForNodeId))

    def getCurrentTerm(self) -> int:
        return self.terms.term

    def getVotedForNodeId(self) -> str | None:
        return self.terms.voted_for

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        """pysyncobj calls this right after its leader advanced the commit index, before
        anything is applied or told to followers: the leader's commit barrier."""
        if self.commit_waits_for_sync():
            self._io(lambda: self.log.wait_durable(raftCommitIndex))
        self.terms.set_commit(raftCommitIndex)

    def getRaftCommitIndex(self) -> int:
        return self.terms.commit_index

    # -- durability
    def sync(self) -> int:
        """Make every staged entry as durable as the mode promises; returns the batch size."""
        return int(self._io(self.log.sync))

    @property
    def unsynced(self) -> bool:
        return self.log.unsynced

    @property
    def stats(self) -> SyncStats:
        return self.log.stats

    def onOneSecondTimer(self) -> None:
        self._io(self.log.sync_every_second)
        self._io(self.terms.flush_commit)
        self._timers += 1
        if self._timers % STATS_EVERY_S == 0 and self.stats.syncs != self._logged_syncs:
            self._logged_syncs = self.stats.syncs
            self._log_stats()

    def _log_stats(self) -> None:
        s = self.stats
        log.info(
            "journal sync stats",
            extra={
                "journal_syncs": s.syncs,
                "journal_entries": s.entries,
                "journal_largest_batch": s.largest_batch,
                "journal_sync_s": round(s.sync_s, 4),
                "journal_batch_sizes": {str(k): v for k, v in sorted(s.batch_sizes.items())},
            },
        )

    def flush(self) -> None:
        self.sync()

    def _destroy(self) -> None:
        if self.stats.syncs != self._logged_syncs:
            self._log_stats()
        self.log.close()
        self.terms.flush_commit()
        self.terms.close()


def open_journal(
    data_dir: str, durability: Durability = Durability.POWER_LOSS, syncer: Syncer = REAL
) -> KvdirJournal:
    """The journal of `data_dir`, migrating pysyncobj's own files there if they are alone."""
    log_path = os.path.join(data_dir, LOG_FILE)
    if not os.path.exists(log_path) and os.path.exists(os.path.join(data_dir, LEGACY_LOG_FILE)):
        _migrate(data_dir, syncer)
    log_file = LogFile(log_path, durability, syncer)
    return KvdirJournal(log_file, TermStore(os.path.join(data_dir, TERM_FILE), syncer))


def legacy_state(data_dir: str) -> tuple[list[Entry], dict[str, Any]]:
    """Entries and meta (term, vote, commit index) of pysyncobj's journal in `data_dir`.

    Read from a copy: pysyncobj's reader resizes the file it opens.
    """
    from pysyncobj.journal import createJournal

    with tempfile.TemporaryDirectory(prefix="kvdir-migrate-") as tmp:
        copy = os.path.join(tmp, LEGACY_LOG_FILE)
        shutil.copyfile(os.path.join(data_dir, LEGACY_LOG_FILE), copy)
        journal = createJournal(copy)
        try:
            entries = [(bytes(c), int(i), int(t)) for c, i, t in journal[0 : len(journal)]]
        finally:
            journal._destroy()
    return entries, _legacy_meta(os.path.join(data_dir, LEGACY_META_FILE))


def _legacy_meta(path: str) -> dict[str, Any]:
    """pysyncobj's pickled meta: a dict of ints and a node id string; nothing else is read."""
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError):
        return {}
    return meta if isinstance(meta, dict) else {}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"journal meta names {module}.{name}")


def _migrate(data_dir: str, syncer: Syncer) -> None:
    entries, meta = legacy_state(data_dir)
    log_path = os.path.join(data_dir, LOG_FILE)
    if os.path.exists(log_path + ".migrating"):
        os.unlink(log_path + ".migrating")  # a migration that did not finish: start over
    staging = LogFile(log_path + ".migrating", Durability.POWER_LOSS, syncer)
    for cmd, idx, term in entries:
        staging.append(cmd, idx, term)
    staging.close()
    terms = TermStore(os.path.join(data_dir, TERM_FILE), syncer)
    vote = meta.get("votedForNodeId")
    terms.set_term(int(meta.get("currentTerm", 0)), vote if isinstance(vote, str) else None)
    terms.set_commit(int(meta.get("raftCommitIndex", 1)))
    terms.flush_commit()
    terms.close()
    os.replace(log_path + ".migrating", log_path)  # the new log exists only once complete
    syncer.directory(data_dir)
    for name in (LEGACY_LOG_FILE, LEGACY_META_FILE):
        old = os.path.join(data_dir, name)
        if os.path.exists(old):
            os.replace(old, old + MIGRATED_SUFFIX)
    syncer.directory(data_dir)
    log.warning(
        "journal: migrated pysyncobj's journal",
        extra={"data_dir": data_dir, "entries": len(entries), "term": terms.term},
    )


# ------------------------------------------------------------ the factory hook

_lock = threading.Lock()
_opened: dict[str, KvdirJournal] = {}
_original: Callable[[str | None], Any] | None = None


def register(journal_file: str, journal: KvdirJournal) -> None:
    """The next SyncObj built with `journalFile=journal_file` gets `journal`."""
    install()
    with _lock:
        _opened[os.path.abspath(journal_file)] = journal


def _create_journal(journal_file: str | None = None) -> Any:
    if journal_file is not None:
        with _lock:
            found = _opened.pop(os.path.abspath(journal_file), None)
        if found is not None:
            return found
    assert _original is not None
    return _original(journal_file)


def install() -> None:
    """Route pysyncobj's `createJournal` through `register`ed journals (idempotent)."""
    global _original  # noqa: PLW0603 (one hook per process, installed once)
    import pysyncobj.syncobj as syncobj_module

    with _lock:
        if _original is None:
            _original = syncobj_module.createJournal
            syncobj_module.createJournal = _create_journal


__all__ = [
    "LOG_FILE",
    "TERM_FILE",
    "KvdirJournal",
    "install",
    "legacy_state",
    "open_journal",
    "register",
]
