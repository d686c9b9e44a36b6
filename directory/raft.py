"""The thin pysyncobj adapter around the pure `Table`.

One replicated entry point (`_apply_blob`) decodes an explicit command and
delegates to `Table.apply`; everything else is plumbing: Raft tuned for ~1 ms
writes and sub-second failover, write outcomes mapped to committed / not
applied / unknown, batched linearizable-read barriers, and snapshots that copy
on the Raft thread and write on another.

Ordering contracts:
- A write's outcome is reported only after this replica applied it (pysyncobj
  calls back from its tick thread after the local apply).
- `apply` and every read take `self.lock`, so a read sees a whole command or
  none of it.
- A linearizable read first commits a Barrier that was proposed *after* the
  read arrived; everything committed before the read began is then applied.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.monotonic import monotonic as raft_clock  # pysyncobj's own clock
from pysyncobj.node import TCPNode

from kvdir.directory import codec, snapshot
from kvdir.directory.commands import Barrier, Command, Result
from kvdir.directory.membership import FencedTransport
from kvdir.directory.table import Table

log = logging.getLogger("kvdir.directory.raft")


@dataclass(frozen=True, slots=True)
class RaftTuning:
    """Raft timing for a 2-core, loopback-or-LAN cluster.

    pysyncobj's defaults batch appends every 100 ms (a write takes 100-200 ms).
    Sending appends immediately gives ~1 ms writes; 150-300 ms election
    timeouts with 30 ms heartbeats give sub-second failover.
    """

    append_entries_period_s: float = 0.03
    election_min_s: float = 0.15
    election_max_s: float = 0.3
    connection_timeout_s: float = 1.0
    leader_fallback_s: float = 1.0
    """A leader cut off from the majority steps down after this long."""
    tick_period_s: float = 0.01
    """How often the Raft thread wakes when no message arrives. pysyncobj's 50 ms
    quantised election timeouts so coarsely that both survivors of a leader
    kill often campaigned in the same tick and split the vote."""
    keepalive_s: float = 0.25
    """Every member pings every other this often (see `_onTick`)."""
    startup_grace_s: float = 1.0
    """A (re)starting replica waits this long for a leader before campaigning,
    so rejoining the cluster does not depose a healthy leader (no pre-vote)."""
    dns_cache_s: float = 10.0
    """How long a peer's resolved address is trusted. pysyncobj's 600 s kept a
    replica that came back on a new IP (a rescheduled pod) unreachable for 10 min."""
    compaction_min_entries: int = 20_000
    compaction_min_time_s: float = 600.0
    commands_queue_max: int = 20_000


class Outcome(Enum):
    COMMITTED = "committed"
    NOT_APPLIED = "not_applied"
    """Definitely not applied: safe to retry."""
    UNKNOWN = "unknown"
    """May or may not have committed (leader changed, or the wait timed out)."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    outcome: Outcome
    result: Result | None = None
    reason: str = ""


_NOT_APPLIED = {
    FAIL_REASON.QUEUE_FULL: "raft command queue is full",
    FAIL_REASON.MISSING_LEADER: "no leader (election in progress or no quorum)",
    FAIL_REASON.DISCARDED: "discarded: a new leader overwrote the entry",
    FAIL_REASON.NOT_LEADER: "the replica forwarded to is no longer leader",
    FAIL_REASON.REQUEST_DENIED: "request denied by raft",
}
_UNKNOWN = {
    FAIL_REASON.LEADER_CHANGED: "leader changed before the commit was confirmed",
    FAIL_REASON.UNKNOWN_OUTCOME: "raft reported an unknown outcome",
}


def outcome_of(error: int) -> tuple[Outcome, str]:
    if error == FAIL_REASON.SUCCESS:
        return Outcome.COMMITTED, ""
    if error in _NOT_APPLIED:
        return Outcome.NOT_APPLIED, _NOT_APPLIED[error]
    return Outcome.UNKNOWN, _UNKNOWN.get(error, f"raft error {error}")


_KEEPALIVE = {"type": "kvdir_keepalive"}
_FOLLOWER = 0  # pysyncobj's _RAFT_STATE.FOLLOWER
_LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER

RaftEntry = tuple[bytes, int, int]
"""(command, index, term) as pysyncobj keeps log entries."""


def trim_append_entries(
    message: dict[str, Any], entry_at: Callable[[int], RaftEntry | None], last_index: int
) -> dict[str, Any]:
    """Drop the part of an AppendEntries this follower already holds.

    pysyncobj's follower truncates its log after `prevLogIdx` whenever it is
    longer, conflict or not. A leader rewinds a follower's next index to the
    follower's last *reported* position while later appends are still in
    flight, so overlapping appends are routine, and the truncation can cut
    entries the follower already acknowledged (and applied) - entries the
    leader may have counted toward a commit. Raft only truncates on a
    conflict. This rewrites an append whose entries all match ours, and
    whose start is behind our log, to start at our last entry, so pysyncobj
    never truncates a matching tail. Anything that looks like a conflict is
    passed through unchanged for the standard handling.

    Our entries beyond the message are kept only if they carry the message's
    term (terms never decrease along a log), i.e. they came from this same
    leader and are therefore in its log.
    """
    prev = message.get("prevLogIdx")
    entries: list[RaftEntry] = message.get("entries") or []
    if prev is None or last_index <= prev:
        return message
    mine = entry_at(prev)
    if mine is None or mine[2] != message.get("prevLogTerm"):
        return message
    for _, idx, term in entries:
        if idx > last_index:
            break
        have = entry_at(idx)
        if have is None or have[2] != term:
            return message
    end = entries[-1][1] if entries else prev
    if end < last_index:
        first_extra, last = entry_at(end + 1), entry_at(last_index)
        if (
            first_extra is None
            or last is None
            or not (first_extra[2] == last[2] == message.get("term"))
        ):
            return message
    last_entry = entry_at(last_index)
    if last_entry is None:
        return message
    out = dict(message)
    out["prevLogIdx"], out["prevLogTerm"] = last_index, last_entry[2]
    out["entries"] = [e for e in entries if e[1] > last_index]
    return out


def _label_kwargs(label: Any) -> dict[str, str]:
    """TCPNode keyword attributes from a snapshot's [replica id, gRPC address] label."""
    if not isinstance(label, list) or len(label) != 2:
        return {}
    return {"kvdir_id": str(label[0]), "kvdir_grpc": str(label[1])}


def rejection_hint(
    proposed: int, mismatch: bool, floor: int | None, commit_index: int, first_index: int
) -> tuple[int, int | None]:
    """The next index a follower names when it rejects an append, and its new floor.

    pysyncobj's follower answers a term mismatch at `prevLogIdx` with
    "retry from prevLogIdx" (one entry back per round trip) and an append that
    starts past its log's end with "retry from my last entry + 1". A follower
    holding a stale tail (a deposed leader's uncommitted entries) receives both
    kinds while the leader keeps sending optimistically from its own end, so
    the second answer keeps undoing the first's progress: measured in
    `kvdir chaos`, a deposed leader stayed stuck for minutes, through a
    restart, never applying again.

    Instead, a mismatch proves our tail conflicts, and every entry up to our
    commit index is in every later leader's log (it is committed), so we name
    commit index + 1 and keep it as a *floor*: until an append succeeds, no
    rejection names anything above it. The leader then sends from a matching
    entry and the conflicting tail is replaced in one round trip. The floor
    never goes below the first entry we still hold (compaction), so the
    leader's prevLogIdx is always one we can check.
    """
    if mismatch:
        floor = max(min(proposed, commit_index + 1), first_index + 1)
    if floor is not None:
        proposed = min(proposed, floor)
    return proposed, floor


@dataclass(slots=True)
class _Round:
    """One barrier serving every linearizable read that joined it."""

    done: threading.Event = field(default_factory=threading.Event)
    outcome: WriteResult | None = None


class DirectoryReplica(SyncObj):  # type: ignore[misc]
    """One directory replica: the table, replicated by pysyncobj."""

    def __init__(
        self,
        self_address: str,
        peer_addresses: list[str],
        data_dir: str,
        tuning: RaftTuning | None = None,
        on_state_changed: Callable[[int, int], None] | None = None,
        cluster_id: str = "",
        join: bool = False,
        password: str | None = None,
        bind_address: str | None = None,
    ) -> None:
        """`password` encrypts and authenticates every Raft message (pysyncobj's
        Fernet, which needs `cryptography`); `bind_address` keeps the Raft port
        on the cluster network (pysyncobj's default binds every interface)."""
        tuning = tuning or RaftTuning()
        self.kvdir_cluster_id = cluster_id  # read by FencedTransport (directory/membership.py)
        os.makedirs(data_dir, exist_ok=True)
        self.lock = threading.Lock()
        self.table = Table()
        self._snap_lock = threading.Lock()
        self._snap_state = SERIALIZER_STATE.NOT_SERIALIZING
        self.last_compaction_s = 0.0
        self.compactions = 0
        self._barrier_lock = threading.Lock()
        self._barrier_inflight: _Round | None = None
        self._barrier_next: _Round | None = None
        self.dump_path = os.path.join(data_dir, "snapshot.bin")
        conf = SyncObjConf(
            appendEntriesUseBatch=False,
            appendEntriesPeriod=tuning.append_entries_period_s,
            raftMinTimeout=tuning.election_min_s,
            raftMaxTimeout=tuning.election_max_s,
            connectionTimeout=tuning.connection_timeout_s,
            connectionRetryTime=tuning.election_min_s,  # redial idle follower links at once
            autoTickPeriod=tuning.tick_period_s,
            dnsCacheTime=tuning.dns_cache_s,
            dnsFailCacheTime=min(tuning.dns_cache_s, 30.0),
            leaderFallbackTimeout=tuning.leader_fallback_s,
            journalFile=os.path.join(data_dir, "journal.bin"),
            fullDumpFile=self.dump_path,
            serializer=self._serialize,
            deserializer=self._deserialize,
            serializeChecker=self._serialize_state,
            logCompactionMinEntries=tuning.compaction_min_entries,
            logCompactionMinTime=tuning.compaction_min_time_s,
            logCompactionSplit=True,
            dynamicMembershipChange=True,
            commandsQueueSize=tuning.commands_queue_max,
            onStateChanged=on_state_changed,
            password=password,
            bindAddress=bind_address or self_address,
        )
        self._keepalive_s = tuning.keepalive_s
        self._leader_loss_spread_s = tuning.election_max_s - tuning.election_min_s
        self._election_s = (tuning.election_min_s, tuning.election_max_s)
        self._next_keepalive = 0.0
        self._reject_floor: int | None = None
        super().__init__(self_address, peer_addresses, conf, transportClass=FencedTransport)
        self._SyncObj__raftElectionDeadline = raft_clock() + tuning.startup_grace_s
        self._joining = join
        """Never campaign before a leader has been heard from (a replica being added)."""

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
        if self._joining:
            # Until the leader adds it, a joining replica's dials are refused right
            # after they connect; campaigning meanwhile would only inflate its term,
            # and that term would depose the leader the moment it is added.
            if self._SyncObj__raftLeader is not None:
                self._joining = False
            else:
                self._SyncObj__raftElectionDeadline = raft_clock() + self._leader_loss_spread_s + 1
        super()._onTick(timeToWait)
        now = time.monotonic()
        if now >= self._next_keepalive:
            self._next_keepalive = now + self._keepalive_s
            transport = self._SyncObj__transport
            for node in list(self.otherNodes):
                transport.send(node, _KEEPALIVE)

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
        """Every message from a peer; appends are trimmed first (`trim_append_entries`)."""
        if isinstance(message, dict) and message.get("type") == _KEEPALIVE["type"]:
            return
        if (
            isinstance(message, dict)
            and message.get("type") == "append_entries"
            and "prevLogIdx" in message
            and "transmission" not in message
        ):
            message = trim_append_entries(message, self._entry_at, self._last_log_index())
        super()._SyncObj__onMessageReceived(node, message)

    def _SyncObj__sendNextNodeIdx(  # noqa: N802 (pysyncobj's name)
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,  # noqa: N803
        success: bool = False,
    ) -> None:
        """A follower's answer to an append; rejections go through `rejection_hint`.

        Runs on the Raft thread. pysyncobj passes `nextNodeIdx` only for a term
        mismatch (None: the append started past our log's end).
        """
        hint = nextNodeIdx
        if success:
            self._reject_floor = None
        elif reset:
            proposed = self._last_log_index() + 1 if hint is None else hint
            hint, self._reject_floor = rejection_hint(
                proposed,
                hint is not None,
                self._reject_floor,
                int(self.raftCommitIndex),
                int(self._SyncObj__raftLog[0][1]),
            )
        super()._SyncObj__sendNextNodeIdx(node, reset=reset, nextNodeIdx=hint, success=success)

    def _entry_at(self, idx: int) -> RaftEntry | None:
        found = self._SyncObj__getEntries(idx, 1)
        return (found[0][0], found[0][1], found[0][2]) if found else None

    def _last_log_index(self) -> int:
        return int(self._SyncObj__getCurrentLogIndex())

    # ------------------------------------------------------------ the one entry

    @replicated  # type: ignore[untyped-decorator]
    def _apply_blob(self, blob: bytes) -> Result:
        cmd = codec.decode(blob)
        with self.lock:
            return self.table.apply(cmd)

    # ------------------------------------------------------------------ writes

    def submit(self, cmd: Command, callback: Callable[[WriteResult], None]) -> None:
        """Propose `cmd`; `callback` runs once, on the Raft thread, with the outcome."""
        blob = codec.encode(cmd)

        def on_done(result: Result | None, error: int) -> None:
            outcome, reason = outcome_of(error)
            callback(WriteResult(outcome, result if outcome is Outcome.COMMITTED else None, reason))

        self._apply_blob(blob, callback=on_done)

    def write(self, cmd: Command, timeout_s: float) -> WriteResult:
        """Propose `cmd` and wait up to `timeout_s` for its outcome."""
        done = threading.Event()
        box: list[WriteResult] = []

        def on_done(res: WriteResult) -> None:
            box.append(res)
            done.set()

        self.submit(cmd, on_done)
        if not done.wait(timeout_s):
            return WriteResult(Outcome.UNKNOWN, None, f"no outcome within {timeout_s:.3f}s")
        return box[0]

    def barrier(self, timeout_s: float) -> WriteResult:
        """Wait until this replica has applied everything committed before the call.

        Reads that arrive while a barrier is in flight share the next one, so a
        burst of linearizable reads costs two Raft round trips, not one each.
        """
        with self._barrier_lock:
            if self._barrier_inflight is None:
                rnd = self._barrier_inflight = _Round()
                start = True
            else:
                if self._barrier_next is None:
                    self._barrier_next = _Round()
                rnd, start = self._barrier_next, False
        if start:
            self._start_round(rnd)
        if not rnd.done.wait(timeout_s) or rnd.outcome is None:
            return WriteResult(Outcome.UNKNOWN, None, f"no barrier within {timeout_s:.3f}s")
        return rnd.outcome

    def _start_round(self, rnd: _Round) -> None:
        def finished(res: WriteResult) -> None:
            rnd.outcome = res
            rnd.done.set()
            with self._barrier_lock:
                nxt, self._barrier_next = self._barrier_next, None
                self._barrier_inflight = nxt
            if nxt is not None:
                self._start_round(nxt)

        self.submit(Barrier(), finished)

    # ---------------------------------------------------------------- status

    def role(self) -> int:
        """0 follower, 1 candidate, 2 leader (pysyncobj's numbering)."""
        return int(self.getStatus()["state"])

    def leader_address(self) -> str | None:
        """The leader's Raft address, or None when this replica cannot reach one.

        pysyncobj forgets a dead leader only when an election starts, and it
        starts one only while connected to some peer; a follower cut off from
        everyone would otherwise keep naming its dead leader forever.
        """
        leader = self._getLeader()
        if leader is None or (leader != self.selfNode and not self.isNodeConnected(leader)):
            return None
        return str(leader.address)

    def members(self) -> list[tuple[str, bool, bool]]:
        """(raft address, connected, is self) for every member."""
        out = [(str(self.selfNode.address), True, True)]
        for node in sorted(self.otherNodes, key=lambda n: str(n.address)):
            out.append((str(node.address), bool(self.isNodeConnected(node)), False))
        return out

    def member_labels(self) -> dict[str, tuple[str, str]]:
        """Raft address -> (replica id, gRPC address) recorded by `kvdir ctl add-replica`.

        The labels travel inside pysyncobj's membership entry (TCPNode keeps
        keyword attributes) and in our snapshots, so members added at run time
        are named on every replica, not only on those whose config lists them.
        """
        out: dict[str, tuple[str, str]] = {}
        for node in list(self.otherNodes):
            rid, grpc_addr = getattr(node, "kvdir_id", ""), getattr(node, "kvdir_grpc", "")
            if rid or grpc_addr:
                out[str(node.address)] = (str(rid), str(grpc_addr))
        return out

    def member_addresses(self) -> list[str]:
        """The Raft addresses of the current membership (self included), sorted."""
        return sorted([str(self.selfNode.address), *(str(n.address) for n in self.otherNodes)])

    def capture_applied(self, timeout_s: float) -> tuple[snapshot.Image, int, int, list[str]]:
        """(image, applied index, its term, members), taken on the Raft thread between applies.

        On any other thread the applied index may trail the table by an entry
        (pysyncobj bumps it after the apply returns); a tick callback runs
        where neither moves. Raises TimeoutError if the Raft thread is stuck.
        """
        box: list[tuple[snapshot.Image, int, int, list[str]]] = []
        done = threading.Event()

        def on_tick() -> None:
            if done.is_set():
                return
            idx = int(self.raftLastApplied)
            entry = self._entry_at(idx)
            with self.lock:
                image = snapshot.capture(self.table)
            box.append((image, idx, entry[2] if entry else 0, self.member_addresses()))
            done.set()

        self.addOnTickCallback(on_tick)
        try:
            if not done.wait(timeout_s):
                raise TimeoutError(f"the raft thread took no snapshot within {timeout_s:.1f}s")
        finally:
            self.removeOnTickCallback(on_tick)
        return box[0]

    # ------------------------------------------------------------- snapshots

    def _serialize(self, _tmp_file: str, data: tuple[Any, Any, Any]) -> None:
        """pysyncobj's compaction hook, on the Raft thread: capture, then write elsewhere.

        pysyncobj renames `_tmp_file` into place as soon as this returns; we
        leave it absent (so that rename fails harmlessly) and publish the dump
        ourselves with an atomic rename when the writer finishes, reporting
        progress through `_serialize_state`.
        """
        t0 = time.perf_counter()
        with self._snap_lock:
            self._snap_state = SERIALIZER_STATE.SERIALIZING
        entry_last, entry_prev, cluster = data
        image = snapshot.capture(self.table)
        raft = {
            "cluster": sorted(str(n.address) for n in cluster),
            "labels": {
                str(n.address): [getattr(n, "kvdir_id", ""), getattr(n, "kvdir_grpc", "")]
                for n in cluster
                if getattr(n, "kvdir_id", "") or getattr(n, "kvdir_grpc", "")
            },
        }
        capture_s = time.perf_counter() - t0
        threading.Thread(
            target=self._write_dump,
            name="kvdir-snapshot",
            daemon=True,
            args=(image, raft, [entry_last, entry_prev], t0, capture_s),
        ).start()

    def _write_dump(
        self,
        image: snapshot.Image,
        raft: dict[str, Any],
        entries: list[snapshot.RaftEntry],
        t0: float,
        capture_s: float,
    ) -> None:
        try:
            snapshot.write(image, self.dump_path, raft, entries)
            state = SERIALIZER_STATE.SUCCESS
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

    def _deserialize(self, path: str) -> tuple[Any, Any, Any]:
        """Load a dump (at start, or one the leader sent): returns pysyncobj's metadata."""
        table, raft, entries = snapshot.read(path)
        with self.lock:
            self.table = table
        labels = raft.get("labels", {})
        cluster = {TCPNode(addr, **_label_kwargs(labels.get(addr))) for addr in raft["cluster"]}
        log.info("snapshot loaded", extra={"entries": table.entries})
        return entries[0], entries[1], cluster
