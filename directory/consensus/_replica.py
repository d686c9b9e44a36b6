"""The private pysyncobj subclass: the table's one replicated entry, safety fixes, snapshots.

Only `syncobj.RaftConsensus` creates and touches a `Replica`; no
other module sees pysyncobj's names. Everything here runs on pysyncobj's tick
thread unless it says otherwise.

Ordering contracts:
- `_apply_blob` applies under `lock`, so a read under `lock` sees a whole
  command or none of it; the apply listener runs after, holding no lock, with
  the entry's index (pysyncobj bumps `raftLastApplied` after the apply returns).
- A write's callback runs after this replica applied it (pysyncobj calls back
  from its tick thread after the local apply).
- A write is appended only by the leader that took it, in the term it took it
  in (`propose_blob`, `_LeaderQueue`); only a Barrier may travel to the leader
  through a follower.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pysyncobj import FAIL_REASON, SyncObjConf, replicated
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.fast_queue import FastQueue
from pysyncobj.monotonic import monotonic as raft_clock  # pysyncobj's own clock
from pysyncobj.node import TCPNode

from kvdir.directory import codec, snapshot
from kvdir.directory.commands import Command, Result
from kvdir.directory.consensus.durable import DurableSyncObj
from kvdir.directory.consensus.fixes import (
    RaftEntry,
    finished_transmission,
    plan_append,
    rejection_hint,
)
from kvdir.directory.consensus.pysyncobj_log import DUMP_FILE, STAGED_DUMP_SUFFIX
from kvdir.directory.consensus.stall import TickWatch
from kvdir.directory.consensus.sync import REAL, Durability, Syncer
from kvdir.directory.consensus.transport import FencedTransport, with_framing
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.table import Table

log = logging.getLogger("kvdir.directory.raft")

_KEEPALIVE = {"type": "kvdir_keepalive"}
_FOLLOWER = 0  # pysyncobj's _RAFT_STATE.FOLLOWER
_LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER
REQUEST_ID_BITS = 62
"""Forwarded commands are numbered from a random start this wide (see `Replica.__init__`)."""

Listener = Callable[[int, Command, Result], None]
Callback = Callable[[Result | None, int], None]


class _Termed:
    """A write's callback, with the term in which this replica, as leader, took it."""

    __slots__ = ("callback", "term")

    def __init__(self, callback: Callback, term: int) -> None:
        self.callback, self.term = callback, term

    def __call__(self, result: Result | None, error: int) -> None:
        self.callback(result, error)


class _LeaderQueue(FastQueue):  # type: ignore[misc]  # pysyncobj is untyped
    """pysyncobj's command queue, which hands the Raft thread a write only while this
    replica still leads the term the write was taken in; any other is refused
    (NOT_LEADER: never appended, so not applied), never forwarded.

    pysyncobj forwards what a follower's queue holds to the leader, and holds
    it while no leader is known. A write a client gave up on (its attempt timed
    out, on a paused or partitioned old leader) then reached the log after the
    client's retry had committed and after the client's next write: an
    acknowledged Remove undone by a late copy of the Publish before it (the
    chaos run of bench/results/chaos-2026-12-04-violation.md). Appended in the
    term it was taken in, a write is either in the log before anything a later
    leader commits, or it is cut with its term and never commits.
    """

    def __init__(self, replica: Replica, size: int) -> None:
        super().__init__(size)
        self.replica = replica

    def get_nowait(self) -> tuple[Any, Any]:
        while True:
            command, callback = super().get_nowait()  # raises Empty: nothing left
            if isinstance(callback, _Termed) and not self.replica.leads(callback.term):
                self.replica.refused_writes += 1
                callback(None, FAIL_REASON.NOT_LEADER)
                continue
            return command, callback


def _in_a_thread(job: Callable[[], None]) -> None:
    threading.Thread(target=job, name="kvdir-snapshot", daemon=True).start()


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a replica does I/O and background work with; production's by default.

    The seeded simulator (bench/sim) swaps these to drive real replicas tick by
    tick: its own transport class, no tick thread, a syncer that records what
    is durable, and background jobs (the dump writer) run when the seed says.
    """

    transport_class: type = FencedTransport
    auto_tick: bool = True
    syncer: Syncer = REAL
    background: Callable[[Callable[[], None]], None] = _in_a_thread


PRODUCTION = Hooks()


def label_kwargs(label: Any) -> dict[str, str]:
    """TCPNode keyword attributes from a snapshot's [replica id, gRPC address] label."""
    if not isinstance(label, list) or len(label) != 2:
        return {}
    return {"kvdir_id": str(label[0]), "kvdir_grpc": str(label[1])}


def node_labels(node: Any) -> tuple[str, str]:
    """(replica id, gRPC address) a TCPNode carries ("" when it carries none)."""
    return str(getattr(node, "kvdir_id", "")), str(getattr(node, "kvdir_grpc", ""))


BIND_RETRY_S = 0.5
BIND_RETRIES = 20  # 10 s


def make_conf(
    replica: Replica,
    tuning: RaftTuning,
    data_dir: str,
    on_state_changed: Callable[[int, int], None] | None,
    password: str | None,
    bind_address: str,
    durability: Durability,
) -> SyncObjConf:
    """Every pysyncobj setting, in one place (the journal and serializer hooks included)."""
    return SyncObjConf(
        appendEntriesUseBatch=False,
        appendEntriesPeriod=tuning.append_entries_period_s,
        raftMinTimeout=tuning.election_min_s,
        raftMaxTimeout=tuning.election_max_s,
        connectionTimeout=tuning.connection_timeout_s,
        connectionRetryTime=tuning.election_min_s,  # redial idle follower links at once
        autoTick=replica.hooks.auto_tick,
        autoTickPeriod=tuning.tick_period_s,
        dnsCacheTime=tuning.dns_cache_s,
        dnsFailCacheTime=min(tuning.dns_cache_s, 30.0),
        leaderFallbackTimeout=tuning.leader_fallback_s,
        journalFile=replica.open_durable_journal(data_dir, durability, replica.hooks.syncer),
        fullDumpFile=replica.dump_path,
        serializer=replica._serialize,
        deserializer=replica._deserialize,
        serializeChecker=replica._serialize_state,
        logCompactionMinEntries=tuning.compaction_min_entries,
        logCompactionMinTime=tuning.compaction_min_time_s,
        logCompactionSplit=True,
        dynamicMembershipChange=True,
        commandsQueueSize=tuning.commands_queue_max,
        onStateChanged=on_state_changed,
        password=password,
        bindAddress=bind_address,
        # pysyncobj retries a failed bind forever by default (maxBindRetries=0): a replica
        # whose Raft port is taken then hangs at start, silently. Retry long enough for a
        # killed predecessor's socket to go, then fail the start with one line.
        bindRetryTime=BIND_RETRY_S,
        maxBindRetries=BIND_RETRIES,
    )


class Replica(DurableSyncObj):
    """One directory replica: the table, replicated by pysyncobj, logged by kvdir's journal."""

    _SyncObj__recvTransmission: Any  # pysyncobj's buffer of a big entry's chunks
    _SyncObj__raftCommitIndex: int
    _SyncObj__commandsLocalCounter: int  # the last forwarded command's request id
    _SyncObj__commandsQueue: FastQueue
    _SyncObj__raftState: int
    _SyncObj__raftCurrentTerm: int

    def __init__(
        self,
        self_address: str,
        peer_addresses: list[str],
        data_dir: str,
        tuning: RaftTuning,
        on_state_changed: Callable[[int, int], None] | None,
        cluster_id: str,
        join: bool,
        password: str | None,
        bind_address: str,
        durability: Durability = Durability.POWER_LOSS,
        hooks: Hooks = PRODUCTION,
    ) -> None:
        self.hooks = hooks
        self.read_before_campaigning = hooks.auto_tick  # the simulator delivers messages itself
        self.kvdir_cluster_id = cluster_id  # read by FencedTransport
        os.makedirs(data_dir, exist_ok=True)
        self.lock = threading.Lock()
        self.table = Table()
        self.listeners: tuple[Listener, ...] = ()
        self.install_listeners: tuple[Callable[[int], None], ...] = ()
        self._listen_lock = threading.Lock()
        self._dispatched = 0
        """The newest index whose command took its listeners (see `add_listener`)."""
        self._snap_lock = threading.Lock()
        self._snap_state = SERIALIZER_STATE.NOT_SERIALIZING
        self.last_compaction_s = 0.0
        self.compactions = 0
        self.dump_path = os.path.join(data_dir, DUMP_FILE)
        conf = make_conf(
            self, tuning, data_dir, on_state_changed, password, bind_address, durability
        )
        self._keepalive_s = tuning.keepalive_s
        self._leader_loss_spread_s = tuning.election_max_s - tuning.election_min_s
        self._election_s = (tuning.election_min_s, tuning.election_max_s)
        self.ticks = TickWatch(tuning.election_min_s / 2)
        """Half the shortest election timeout: a gap this long eats most of a follower's
        patience, and a leader's twice as long is an election."""
        self._next_keepalive = 0.0
        self._reject_floor: int | None = None
        self._proven_end: int | None = None
        self._voters: dict[Any, set[Any]] = {}
        """The peers whose vote answers were counted, by term (the current one only)."""
        """While a message is handled, the last index a success answer may claim: what
        an append proves (`AppendPlan.proven_end`), or an installed snapshot's index."""
        transport = with_framing(hooks.transport_class)
        super().__init__(self_address, peer_addresses, conf, transportClass=transport)
        # pysyncobj numbers the commands a follower forwards from 0 in every process and
        # matches answers by number alone. A peer still holding a forwarded command of
        # this replica's previous run (queued while it had no leader) answers it later,
        # and that answer was taken for this run's command of the same number: a client
        # acknowledged with another entry's result, or told NOT_APPLIED of a write that
        # then committed (seeds 7205, 6296). A random start keeps runs apart.
        self._SyncObj__commandsLocalCounter = secrets.randbits(REQUEST_ID_BITS)
        self._SyncObj__raftElectionDeadline = raft_clock() + tuning.startup_grace_s
        self._joining = join
        """Never campaign before a leader has been heard from (a replica being added)."""
        self.refused_writes = 0
        """Writes refused because this replica did not lead their term (`_LeaderQueue`)."""
        self._SyncObj__commandsQueue = _LeaderQueue(self, tuning.commands_queue_max)

    # ------------------------------------------------------------ raft safety

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 (pysyncobj's name)
        """One Raft tick, then keepalives to every other member.

        Followers never talk to each other, and pysyncobj drops a link that has
        been silent for `connection_timeout_s` the moment something is sent on
        it: that first message is a vote request when the leader dies, so the
        survivors could not campaign until they had re-dialled each other.
        Pinging keeps every link warm. Runs on the Raft thread (the transport
        is not thread-safe).
        """
        if self.hooks.auto_tick:  # the simulator's ticks run on its own clock
            self._watch_tick()
        if self._joining:
            # Until the leader adds it, a joining replica's dials are refused right
            # after they connect; campaigning meanwhile would only inflate its term,
            # and that term would depose the leader the moment it is added.
            if self._SyncObj__raftLeader is not None:
                self._joining = False
            else:
                self._SyncObj__raftElectionDeadline = raft_clock() + self._leader_loss_spread_s + 1
        super()._onTick(timeToWait)
        now = raft_clock()
        if now >= self._next_keepalive:
            self._next_keepalive = now + self._keepalive_s
            transport = self._SyncObj__transport
            for node in list(self.otherNodes):
                transport.send(node, _KEEPALIVE)

    def _watch_tick(self) -> None:
        stall = self.ticks.tick(raft_clock(), self.kvdir_journal.stats.sync_s)
        if stall is not None:
            log.warning(
                "raft thread stalled",
                extra={
                    "gap_ms": round(stall.gap_s * 1e3, 1),
                    "fdatasync_ms": round(stall.fdatasync_s * 1e3, 1),
                    "role": self.role(),
                },
            )

    def _SyncObj__onNodeDisconnected(self, node: Any) -> None:  # noqa: N802
        """A lost link to the leader starts the election early (within a random spread).

        When a leader process dies its sockets close at once, so its followers
        know before any heartbeat is missed. Campaigning after a random delay of
        up to one election-timeout spread (instead of a full timeout) halves the
        write gap of a leader crash; the randomness keeps the two survivors from
        splitting the vote. A partition closes no socket and still waits for the
        normal timeout. Runs on the Raft thread.
        """
        super()._SyncObj__onNodeDisconnected(node)
        if node == self._SyncObj__raftLeader and self._SyncObj__raftState == _FOLLOWER:
            soon = raft_clock() + random.uniform(0.0, self._leader_loss_spread_s)
            self._SyncObj__raftElectionDeadline = min(self._SyncObj__raftElectionDeadline, soon)

    def _SyncObj__setState(self, newState: int) -> None:  # noqa: N802, N803
        """A leader that steps down waits a fresh election timeout before campaigning.

        pysyncobj leaves a leader's (long expired) election deadline as it was,
        so a deposed leader campaigned on its next tick; after a leadership
        hand-over (`kvdir ctl remove-replica` of the leader) it often won back
        at once, over and over. Runs on the Raft thread.
        """
        was_leader = self._SyncObj__raftState == _LEADER
        super()._SyncObj__setState(newState)
        if was_leader and newState != _LEADER:
            self._SyncObj__raftElectionDeadline = raft_clock() + random.uniform(*self._election_s)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        """Every message from a peer; appends go through `plan_append` first.

        The last chunk of an entry sent in chunks becomes an ordinary append
        here (`finished_transmission`), so it meets the same rule.
        """
        try:
            self._on_message(node, message)
        finally:
            self._proven_end = None

    def _on_message(self, node: Any, message: Any) -> None:
        if isinstance(message, dict) and message.get("type") == _KEEPALIVE["type"]:
            return
        if isinstance(message, dict) and message.get("type") == "response_vote":
            # pysyncobj counts vote answers, not voters: one answer delivered twice
            # (the seeded simulator duplicates messages) made a leader of a minority.
            voters = self._voters.setdefault(message.get("term"), set())
            if node in voters:
                return
            if len(self._voters) > 1:  # only the current election's answers matter
                self._voters = {message.get("term"): voters}
            voters.add(node)
        if isinstance(message, dict) and message.get("type") == "append_entries":
            # A middle chunk whose first one never came (lost, or we restarted) would
            # fail in pysyncobj; the leader sends the entry again from its start.
            started = isinstance(self._SyncObj__recvTransmission, bytes)
            if message.get("transmission") == "process" and not started:
                return
            if message.get("transmission") == "finish":
                message = finished_transmission(self._SyncObj__recvTransmission, message)
                if message is None:
                    return
                if "transmission" not in message:
                    self._SyncObj__recvTransmission = ""
            if "prevLogIdx" in message and "transmission" not in message:
                self._append(node, message)
                return
            if "prevLogIdx" not in message:
                # A snapshot chunk (or its placeholder, None while the leader's dump is
                # being written) proves nothing about our log; its last one loads the
                # snapshot, which commits up to its own index. pysyncobj would raise
                # our commit index over whatever our log holds, unproven entries too.
                held = min(int(message.get("commit_index", 0)), int(self.raftCommitIndex))
                message = dict(message, commit_index=held)
        super()._SyncObj__onMessageReceived(node, message)

    def _append(self, node: Any, message: dict[str, Any]) -> None:
        plan = plan_append(message, self.entry_at, self.last_log_index(), int(self.raftCommitIndex))
        if plan.message is None:
            log.warning(
                "dropped an append that would cut a committed entry",
                extra={
                    "peer": str(getattr(node, "address", node)),
                    "term": message.get("term"),
                    "conflict_at": plan.conflict_at,
                    "commit_index": int(self.raftCommitIndex),
                },
            )
            return
        self._proven_end = plan.proven_end
        super()._SyncObj__onMessageReceived(node, plan.message)

    def _SyncObj__sendNextNodeIdx(  # noqa: N802 (pysyncobj's name)
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,  # noqa: N803
        success: bool = False,
    ) -> None:
        """A follower's answer to an append; rejections go through `rejection_hint`,
        a success claims no more than the append proved (`AppendPlan.proven_end`).

        Runs on the Raft thread. pysyncobj passes `nextNodeIdx` only for a term
        mismatch or a success (None: the append started past our log's end, or
        a snapshot was installed: our last entry + 1).
        """
        hint = nextNodeIdx
        if success:
            self._reject_floor = None
            if self._proven_end is not None:  # claim no more than the append proved
                claimed = self.last_log_index() if hint is None else hint - 1
                hint = min(claimed, self._proven_end) + 1
        elif reset:
            proposed = self.last_log_index() + 1 if hint is None else hint
            hint, self._reject_floor = rejection_hint(
                proposed,
                hint is not None,
                self._reject_floor,
                int(self.raftCommitIndex),
                int(self._SyncObj__raftLog[0][1]),
            )
        super()._SyncObj__sendNextNodeIdx(node, reset=reset, nextNodeIdx=hint, success=success)

    # ------------------------------------------------------------ log reads

    def entry_at(self, idx: int) -> RaftEntry | None:
        found = self._SyncObj__getEntries(idx, 1)
        return (found[0][0], found[0][1], found[0][2]) if found else None

    def last_log_index(self) -> int:
        return int(self._SyncObj__getCurrentLogIndex())

    def role(self) -> int:
        """0 follower, 1 candidate, 2 leader (pysyncobj's numbering)."""
        return int(self._SyncObj__raftState)

    # ------------------------------------------------------------ the one entry

    @replicated  # type: ignore[untyped-decorator]
    def _apply_blob(self, blob: bytes) -> Result:
        cmd = codec.decode(blob)
        index = int(self.raftLastApplied) + 1  # bumped by pysyncobj once this returns
        with self.lock:
            result = self.table.apply(cmd)
        with self._listen_lock:
            listeners, self._dispatched = self.listeners, index
        for listener in listeners:
            try:
                listener(index, cmd, result)
            except Exception:  # a listener's bug must not stop the Raft thread
                log.exception("apply listener failed", extra={"index": index})
        return result

    def add_listener(self, fn: Listener, on_install: Callable[[int], None] | None) -> int:
        """Register from any thread; returns the index after which `fn` sees every
        command. Exact without waiting for the Raft thread: a command past the
        returned index takes its listeners after this registration."""
        with self._listen_lock:
            self.listeners = (*self.listeners, fn)
            if on_install is not None:
                self.install_listeners = (*self.install_listeners, on_install)
            return max(self._dispatched, int(self.raftLastApplied))

    def _installed(self, index: int) -> None:
        """Tell the install listeners (none yet when the dump loads at start)."""
        with self._listen_lock:
            listeners = self.install_listeners
            self._dispatched = max(self._dispatched, index)
        for listener in listeners:
            try:
                listener(index)
            except Exception:  # as for apply listeners: never stop the Raft thread
                log.exception("install listener failed", extra={"index": index})

    def leads(self, term: int) -> bool:
        """Whether this replica is the leader of `term` now."""
        return self._SyncObj__raftState == _LEADER and self._SyncObj__raftCurrentTerm == term

    def propose_blob(self, blob: bytes, callback: Callback, may_forward: bool = False) -> None:
        """Propose a command; any thread. A write (`may_forward` False) is taken only
        while this replica leads, and appended only in the term it was taken in
        (`_LeaderQueue`); elsewhere it is refused at once (NOT_LEADER), so a client
        that retries at the leader can never see this copy land after its retry.
        `may_forward`: a command with no effect (a Barrier) may reach the leader
        through this replica, as pysyncobj forwards it."""
        if may_forward:
            self._apply_blob(blob, callback=callback)
            return
        # The term first: if this replica leads when its state is read, it leads that
        # term or a later one (then the queue refuses the write: not applied, truly).
        term = int(self._SyncObj__raftCurrentTerm)
        if self._SyncObj__raftState != _LEADER:
            self.refused_writes += 1
            callback(None, FAIL_REASON.NOT_LEADER)
            return
        self._apply_blob(blob, callback=_Termed(callback, term))

    # ------------------------------------------------------------- snapshots

    def _serialize(self, _tmp_file: str, data: tuple[Any, Any, Any]) -> None:
        """pysyncobj's compaction hook, on the Raft thread: freeze, then copy and write elsewhere.

        pysyncobj renames `_tmp_file` into place as soon as this returns; we
        leave it absent (so that rename fails harmlessly) and publish the dump
        ourselves with an atomic rename when the writer finishes, reporting
        progress through `_serialize_state`.
        """
        t0 = time.perf_counter()
        with self._snap_lock:
            self._snap_state = SERIALIZER_STATE.SERIALIZING
        entry_last, entry_prev, cluster = data
        cluster = self.membership_at(entry_last[1], cluster)  # not changes past the dump
        frozen = snapshot.freeze(self.table)  # O(nodes): the copy is the writer's
        raft = {
            "cluster": sorted(str(n.address) for n in cluster),
            "labels": {
                str(n.address): list(node_labels(n)) for n in cluster if any(node_labels(n))
            },
        }
        capture_s = time.perf_counter() - t0
        entries = [entry_last, entry_prev]
        self.hooks.background(lambda: self._write_dump(frozen, raft, entries, t0, capture_s))

    def _write_dump(
        self,
        frozen: snapshot.Frozen,
        raft: dict[str, Any],
        entries: list[snapshot.RaftEntry],
        t0: float,
        capture_s: float,
    ) -> None:
        try:
            image = frozen.image()
            staged = self.dump_path + STAGED_DUMP_SUFFIX
            snapshot.write(image, staged, raft, entries, self.hooks.syncer)
            snapshot.drop(image)  # freed a chunk at a time, never in one GIL hold
            state = SERIALIZER_STATE.SUCCESS  # also when not published: the log is past it
            if self.publish_dump(staged, entries[0][1]):
                self.last_compaction_s = time.perf_counter() - t0
                self.compactions += 1
                log.info(
                    "compaction done",
                    extra={
                        "entries": image.meta["entries"],
                        "capture_s": round(capture_s, 4),
                        "total_s": round(self.last_compaction_s, 4),
                    },
                )
        except Exception:
            log.exception("compaction failed")
            state = SERIALIZER_STATE.FAILED
        with self._snap_lock:
            self._snap_state = state

    def _serialize_state(self) -> int:
        with self._snap_lock:
            state = self._snap_state
            if state in (SERIALIZER_STATE.SUCCESS, SERIALIZER_STATE.FAILED):
                self._snap_state = SERIALIZER_STATE.NOT_SERIALIZING
            return int(state)

    def snapshot_index(self, path: str) -> int:
        return snapshot.index_of(path)

    def snapshot_members(self, path: str) -> frozenset[str]:
        return frozenset(str(a) for a in snapshot.raft_meta_of(path).get("cluster", ()))

    def _deserialize(self, path: str) -> tuple[Any, Any, Any]:
        """Load a dump (at start, or one the leader sent): returns pysyncobj's metadata."""
        table, raft, entries = snapshot.read(path)
        with self.lock:
            self.table = table
        # pysyncobj sets raftLastApplied to the newer of the two entries right after.
        index = max(entries[0][1], entries[1][1])
        self._installed(index)
        self.dump_index = index
        # A snapshot install's success answer claims the snapshot, not the entries
        # kept after it: those are proven by the leader's next append.
        self._proven_end = index
        # Everything in a snapshot is committed; the commit index saved beside the
        # log is flushed about once a second and may lag it.
        self._SyncObj__raftCommitIndex = max(self._SyncObj__raftCommitIndex, index)
        labels = raft.get("labels", {})
        cluster = {TCPNode(addr, **label_kwargs(labels.get(addr))) for addr in raft["cluster"]}
        log.info("snapshot loaded", extra={"entries": table.entries})
        return entries[0], entries[1], cluster
