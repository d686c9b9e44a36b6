"""A pysyncobj SyncObj that acknowledges only what its journal has made durable.

Raft's promise - an acknowledged write survives - holds only if every replica
counted toward a commit had the entry on stable storage when it was counted.
pysyncobj assumes its journal write is durable the moment `add` returns;
kvdir's journal stages the entry and makes it durable in batches. So:

- a follower's success answer to an AppendEntries is held (`AckGate`) and
  released after the next `sync()`, at the start of the next Raft tick: one
  fdatasync for every append the last poll delivered (group commit); answers
  held when a conflicting tail is cut are dropped, not sent;
- the leader counts itself toward a commit in the tick's commit step, so its
  own entries - proposals drained from the queue in a tick, the no-op of a
  new term - must be durable before a commit index covers them: they are
  synced at the end of the drain and when it becomes leader (the appends to
  the followers go out first, so the leader's fdatasync overlaps theirs), and
  as a barrier every commit index pysyncobj sets on a leader waits until its
  journal is durable that far (`setRaftCommitIndex` is called before anything
  is applied or sent);
- term and vote are synced inside `setCurrentTerm` (votes.py), before pysyncobj
  sends anything reflecting them;
- a snapshot received from the leader is written by pysyncobj without fsync:
  it is synced (file and directory) before it is loaded and the log cut at
  its anchor; entries after the anchor that follow it stay (Raft's rule), so
  a restart between a compaction's dump rename and its log trim loses none;
- a compaction's dump is renamed into place only if it is newer than the one
  there (`publish_dump`), so it never replaces a snapshot installed meanwhile.

A failed write or sync ends the process (`stop_on_journal_failure`):
pysyncobj's tick loop would log the error and go on with a term or log it
had changed in memory only. A restart recovers from what is on disk.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.monotonic import monotonic  # pysyncobj's clock: its deadlines are read on it
from pysyncobj.node import Node

from kvdir.directory.consensus.acks import AckGate, Reply
from kvdir.directory.consensus.pysyncobj_journal import (
    LOG_FILE,
    KvdirJournal,
    open_journal,
    register,
)
from kvdir.directory.consensus.sync import REAL, Durability, Syncer, replace_freeing_later

log = logging.getLogger("kvdir.directory.journal")

_LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER
EXIT_JOURNAL_FAILED = 74
"""EX_IOERR: the exit status of a replica whose journal could not be written."""


def stop_on_journal_failure(error: BaseException) -> None:
    log.critical(
        "journal write failed: stopping this replica (a restart recovers from what is on disk)",
        extra={"error": str(error)},
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_JOURNAL_FAILED)


def sync_file(path: str, syncer: Syncer = REAL) -> None:
    """Sync an existing file and its directory (a file another library wrote and renamed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        syncer.file(fd)
    finally:
        os.close(fd)
    syncer.directory(os.path.dirname(os.path.abspath(path)))


class DurableSyncObj(SyncObj):  # type: ignore[misc]
    """SyncObj with kvdir's journal: call `open_durable_journal` before `SyncObj.__init__`."""

    kvdir_journal: KvdirJournal
    _kvdir_acks: AckGate

    def open_durable_journal(
        self, data_dir: str, durability: Durability, syncer: Syncer = REAL
    ) -> str:
        """Open (or migrate) the journal of `data_dir`; returns the SyncObjConf journalFile."""
        journal = open_journal(data_dir, durability, syncer)
        self._kvdir_syncer = syncer
        self._dump_lock = threading.Lock()
        self.dump_index = 0
        """The last entry of the dump in place; set by the deserializer, `publish_dump`."""
        self.dumps_discarded = 0
        self._sends_guarded = False
        self._dump_names_self_at: tuple[int, bool] | None = None
        """(dump_index, whether that dump's membership names this replica)."""
        self._split_paused = False
        self._membership_replayed = False
        """Whether the first tick (after the dump, if any, loaded) replayed the log's
        membership changes: a member uses the latest membership in its log, but
        pysyncobj makes those past the snapshot only as it applies them, and after a
        power cut of every member the commit index it stored may be behind them."""
        journal.on_failure = stop_on_journal_failure
        journal.commit_waits_for_sync = lambda: self._SyncObj__raftState == _LEADER
        path = os.path.join(data_dir, LOG_FILE)
        register(path, journal)
        self.kvdir_journal = journal
        self._kvdir_acks = AckGate(journal, self._send_held_answer)
        return path

    read_before_campaigning = False
    """Set by a replica whose sockets are real (see `_read_before_campaigning`)."""

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 (pysyncobj's names)
        self._kvdir_acks.release()  # what the last poll appended, then the answers it earned
        if self.read_before_campaigning:
            self._read_before_campaigning()
        if not self._sends_guarded:
            self._guard_snapshot_sends()
        super()._onTick(timeToWait)
        if self._split_paused and not self._SyncObj__forceLogCompaction:
            self._SyncObj__conf.logCompactionSplit = True  # the dump was asked for
            self._split_paused = False
        if not self._membership_replayed and not self._SyncObj__needLoadDumpFile:
            self._membership_replayed = True
            applied = int(self._SyncObj__raftLastApplied)
            self._reapply_membership([e for e in self.kvdir_journal.log.entries if e[1] > applied])

    def _read_before_campaigning(self) -> None:
        """A follower whose election deadline has passed reads its sockets before the tick.

        pysyncobj checks the deadline at the top of a tick and reads the sockets
        at its end. A follower whose Raft thread was held up past its election
        timeout after its last read (the fdatasync in `release` waiting behind
        another file's writeback, the GIL) campaigned although the leader's
        heartbeats sat unread in its socket, deposing a live leader. Reading
        them first resets the deadline when the leader is alive; a follower that
        really heard nothing still campaigns. What this read appends is synced
        and answered at the next tick, as after any read.
        """
        if self._SyncObj__raftState == _LEADER or not self._SyncObj__transport.ready:
            return
        if self._SyncObj__raftElectionDeadline < monotonic():
            self._poller.poll(0)

    def _checkCommandsToApply(self) -> None:  # noqa: N802
        super()._checkCommandsToApply()
        self._kvdir_acks.release()
        self.kvdir_journal.sync()  # the leader's new entries, before its next commit count

    def _SyncObj__onBecomeLeader(self) -> None:  # noqa: N802
        super()._SyncObj__onBecomeLeader()
        self.kvdir_journal.sync()  # the new term's no-op (a lone member commits it this tick)

    def _SyncObj__sendNextNodeIdx(  # noqa: N802
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,  # noqa: N803
        success: bool = False,
    ) -> None:
        reply: Reply = {"reset": reset, "nextNodeIdx": nextNodeIdx, "success": success}
        if not self._kvdir_acks.hold(node, reply):
            super()._SyncObj__sendNextNodeIdx(node, **reply)

    def _SyncObj__deleteEntriesFrom(self, fromIDx: int) -> None:  # noqa: N802, N803
        self._kvdir_acks.discard()  # they may cover entries this cut removes
        super()._SyncObj__deleteEntriesFrom(fromIDx)

    def _send_held_answer(self, node: Any, reply: Reply) -> None:
        SyncObj._SyncObj__sendNextNodeIdx(self, node, **reply)

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:  # noqa: N802, N803
        """Load the dump; the log is cut at its anchor (`KvdirJournal._anchor`), not cleared.

        Runs on the Raft thread: at start (`clearJournal` False) and for a
        snapshot the leader sent (True), with `_dump_lock` held (see
        `_SyncObj__onMessageReceived`).
        """
        dump = self._SyncObj__conf.fullDumpFile
        if dump and os.path.isfile(dump):
            sync_file(dump, self._kvdir_syncer)  # before the log it replaces is cut
        self._kvdir_acks.discard()  # they may cover entries the snapshot replaces
        super()._SyncObj__loadDumpFile(clearJournal)
        if clearJournal:
            self._reapply_membership(self.kvdir_journal.log.entries[2:])

    def _reapply_membership(self, kept: list[tuple[bytes, int, int]]) -> None:
        """Membership changes in the entries kept past an installed snapshot, again.

        pysyncobj applies a membership change when the entry is appended, and
        resets the membership to the snapshot's when it loads one; the kept
        entries were appended before, so their changes are made once more.
        """
        for command, _, _ in kept:
            request = self._SyncObj__parseChangeClusterRequest(command)
            if request is not None:
                self._SyncObj__doChangeCluster(request)

    def membership_at(self, index: int, members: set[Any]) -> set[Any]:
        """The membership `members` (today's) had at log entry `index`: the changes
        in the log past it undone, newest first. Raft thread.

        pysyncobj makes a change when its entry is appended and stores today's
        membership in a dump anchored at the applied index; a change past the
        anchor, not yet committed, may be cut later, and a dump that kept it
        would bring it back at every restart or install (seed 8291: a member
        removed by a cut entry went on voting elsewhere, two leaders in a term).
        Changes naming this replica are skipped, as pysyncobj skips them.
        """
        nodes = set(members)
        later = [e for e in self.kvdir_journal.log.entries if e[1] > index]
        for command, _, _ in reversed(later):
            request = self._SyncObj__parseChangeClusterRequest(command)
            if request is None or request[0] not in ("add", "rem"):
                continue
            node = request[2] if len(request) >= 3 else request[1]
            if not isinstance(node, Node):
                node = self._SyncObj__nodeClass(node)
            if node == self._SyncObj__selfNode:
                continue
            if request[0] == "add":
                nodes.discard(node)
            else:
                nodes.add(node)
        return nodes

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        """A snapshot chunk from the leader is handled under `_dump_lock`: its last
        chunk renames the dump into place and loads it (`publish_dump`)."""
        if isinstance(message, dict) and message.get("serialized") is not None:
            with self._dump_lock:
                self._snapshot_chunk(node, message)
        else:
            super()._SyncObj__onMessageReceived(node, message)

    def _snapshot_chunk(self, node: Any, message: dict[str, Any]) -> None:
        """The last chunk installs the snapshot only if it is newer than our dump.

        pysyncobj renames a received snapshot over the dump in place before
        anything can look at it. One no newer than ours (a duplicate, or a
        leader's resend that crossed our own compaction) would pair an older
        table with a journal already trimmed past it, and a restart would then
        drop the whole journal (seed 2797: a follower lost 20 committed
        entries and voted a stale leader in). So, for this message only, the
        serializer's last step reads the received file's index first and
        deletes a stale one; its answer then claims our commit index, which
        every leader's log holds.
        """
        serializer = self._SyncObj__serializer
        finish = serializer.setTransmissionData
        stale: list[int] = []

        def receive(chunk: Any) -> bool:
            data, first, last = chunk
            if not last:
                return bool(finish(chunk))
            finish((data, first, False))  # written, the file left open
            incoming = serializer._Serializer__incomingTransmissionFile
            if incoming is None:
                return False  # pysyncobj dropped this transmission
            staged = f"{serializer._Serializer__fileName}.1.tmp"  # pysyncobj's name for it
            incoming.flush()
            try:
                index = self.snapshot_index(staged)
            except Exception:  # a damaged transfer: dropped, the leader sends it again
                log.exception("snapshot install: the received file is unreadable")
                index = -1
            if index > self.dump_index:
                return bool(finish((b"", False, True)))
            incoming.close()
            serializer._Serializer__incomingTransmissionFile = None
            os.unlink(staged)
            stale.append(index)
            return False

        serializer.setTransmissionData = receive
        try:
            super()._SyncObj__onMessageReceived(node, message)
        finally:
            del serializer.setTransmissionData  # the class's method again
        if stale and stale[0] >= 0:
            log.info(
                "snapshot install: ours is as new, the leader's is dropped",
                extra={"snapshot_index": stale[0], "in_place": self.dump_index},
            )
            commit = int(self._SyncObj__raftCommitIndex)
            self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=commit + 1, success=True)

    def snapshot_index(self, path: str) -> int:
        """The last entry the snapshot file at `path` covers (the adapter knows its format)."""
        raise NotImplementedError

    def snapshot_members(self, path: str) -> frozenset[str]:
        """The Raft addresses of the membership the snapshot at `path` holds."""
        raise NotImplementedError

    def _guard_snapshot_sends(self) -> None:
        """A leader never starts sending a dump whose membership lacks the leader.

        A replica removed and added back may hold only a dump older than its
        re-addition (one it installed from the leader of the time; pysyncobj's split
        compaction lets it dump again only in its own window of every
        `compaction_min_time_s`). Sent to a follower, that dump's membership
        (right for its index) replaces the follower's, which then refuses the link
        to the leader, a peer it does not know, and never receives the entries that
        would add it back (seed 3427: with the third member removed, no election
        could be won again). The leader dumps now instead, outside its window (its
        own dumps always name it), and sends that one; until it is in place the
        follower gets what pysyncobj sends while a dump is being written. Raft
        thread (pysyncobj asks for the data while it sends appends)."""
        serializer = self._SyncObj__serializer
        send = serializer.getTransmissionData

        def guarded(node: Any) -> Any:
            if node not in serializer._Serializer__transmissions and not self._dump_names_self():
                if not self._split_paused:
                    log.info(
                        "snapshot send held: the dump in place predates this replica's "
                        "membership; dumping now",
                        extra={"dump_index": self.dump_index},
                    )
                    self._SyncObj__conf.logCompactionSplit = False
                    self._split_paused = True
                self._SyncObj__forceLogCompaction = True
                return None
            return send(node)

        serializer.getTransmissionData = guarded
        self._sends_guarded = True

    def _dump_names_self(self) -> bool:
        index = self.dump_index
        if self._dump_names_self_at is None or self._dump_names_self_at[0] != index:
            try:
                members = self.snapshot_members(self._SyncObj__conf.fullDumpFile)
            except (OSError, ValueError):
                return True  # no readable dump: nothing of this kind can be sent
            me = str(self._SyncObj__selfNode.address)
            self._dump_names_self_at = (index, me in members)
        return self._dump_names_self_at[1]

    def publish_dump(self, staged: str, index: int) -> bool:
        """Rename a compaction's dump (durable at `staged`) into place, unless older.

        A compaction captures the table on the Raft thread and writes the dump
        on another; a snapshot from the leader may be installed meanwhile, and
        renaming the older dump over it would pair the log, already cut at the
        newer snapshot, with an older table: a restart would then lose every
        entry in between. So a dump whose last entry is not past `dump_index`
        is deleted instead. Returns whether it was published. Any thread.
        """
        dump = self._SyncObj__conf.fullDumpFile
        with self._dump_lock:
            if index <= self.dump_index:
                os.unlink(staged)
                self.dumps_discarded += 1
                log.info(
                    "compaction: a newer snapshot is in place, this dump is dropped",
                    extra={"dump_index": index, "in_place": self.dump_index},
                )
                return False
            replace_freeing_later(staged, dump, self._kvdir_syncer)
            self.dump_index = index
            return True


__all__ = ["EXIT_JOURNAL_FAILED", "DurableSyncObj", "stop_on_journal_failure", "sync_file"]
