"""The Watch RPC of a replica: its committed log as a stream (the .proto has the contract).

A stream starts either from the hub's history (the caller's `from_index` is
still covered) or from a snapshot captured between two applies, atomically
with the watcher's registration, then relays what the hub queues for it, and
a heartbeat when nothing came for `heartbeat_ms`. Every event carries the
replica's applied and commit index, so a mirror knows how far behind it is,
and the cluster id, so a mirror never resumes by index into another cluster's
log (after a `restore`, index N names another command).

A watcher filtered to some namespaces gets a snapshot of those namespaces'
entries and every node (`snapshot.restrict`), the table its stream then
keeps up to date.

The work on the apply path is `observe` (one reference appended per
watcher); everything else (narrowing and encoding the snapshot, messages)
runs on the stream's own gRPC thread.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import weakref
from collections.abc import Iterator

import grpc

from kvdir.directory import codec, snapshot, validate
from kvdir.directory.commands import (
    Barrier,
    ClearNode,
    Command,
    Import,
    Publish,
    Rejected,
    Remove,
    Result,
)
from kvdir.directory.consensus.port import Capture, Consensus
from kvdir.directory.limits import WatchLimits
from kvdir.directory.watch_hub import Batch, CutOff, Refused, Watcher, WatchHub
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.directory.watch")

CAPTURE_TIMEOUT_S = 5.0
"""Longest a new watcher waits for the apply thread to capture its snapshot."""


def namespace_of(cmd: Command) -> str | None:
    """The namespace a command touches; None for node-wide commands."""
    if isinstance(cmd, Import):  # a moved shard's command: its own namespace
        cmd = cmd.inner
    if isinstance(cmd, Publish | Remove):
        return cmd.namespace
    if isinstance(cmd, ClearNode) and not cmd.deregister:
        return cmd.namespace
    return None


def changes_table(cmd: Command, result: Result) -> bool:
    """Whether a mirror must apply this command (refused ones and barriers change nothing)."""
    return not isinstance(cmd, Barrier) and not isinstance(result, Rejected)


class WatchService:
    """Watch over one replica's `Consensus`: call `attach` once, before serving."""

    def __init__(self, consensus: Consensus, replica_id: str, limits: WatchLimits) -> None:
        self.consensus = consensus
        self.replica_id = replica_id
        self.limits = limits
        self.hub = WatchHub(limits, self._applied_index)
        self._snapshots = threading.BoundedSemaphore(limits.snapshots_inflight_max)
        self._capture_lock = threading.Lock()
        self._shared: tuple[weakref.ref[Capture], float] | None = None
        """The latest capture while a start still uses it, and when it was taken
        (time.monotonic), for `_capture`. Weak: a copied table is freed with its last user."""

    def attach(self) -> None:
        """Follow the replica's applies and snapshot installs from now on."""
        self.hub.anchor(self.consensus.add_apply_listener(self.observe, self.hub.reset))

    def _applied_index(self) -> int:
        return self.consensus.status().applied_index

    def observe(self, index: int, cmd: Command, result: Result) -> None:
        """The apply listener (consensus thread, before the applied index counts `index`).

        The command is encoded again here, since the port hands decoded commands
        (the in-memory implementation never had bytes); the codec is canonical,
        so these are the bytes the log holds."""
        if changes_table(cmd, result):
            self.hub.committed(index, codec.encode(cmd), namespace_of(cmd))

    def _event(self, applied: int) -> pb.WatchEvent:
        st = self.consensus.status()
        return pb.WatchEvent(
            applied_index=applied,
            commit_index=max(st.commit_index, applied),
            replica_id=self.replica_id,
            command_version=codec.VERSION,
            cluster_id=st.cluster_id,
        )

    def watch(self, req: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchEvent]:
        """The RPC: `open`, then `next_event` until the caller goes or is cut off."""
        try:
            w, chunks = self.open(req)
        except validate.BadRequest as e:
            context.set_trailing_metadata((("kvdir-reason", e.reason),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Refused as e:
            context.set_trailing_metadata((("kvdir-reason", e.reason),))
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        w.on_cut = lambda: self._cancel_later(context)
        try:
            yield from chunks
            wait_s = self.limits.heartbeat_ms / 1000
            while context.is_active():
                ev = self.next_event(w, wait_s)
                if isinstance(ev, CutOff):
                    log.info("watcher cut off", extra={"reason": ev.reason, "at": ev.resume_from})
                    context.set_trailing_metadata((("kvdir-reason", ev.reason),))
                    context.abort(getattr(grpc.StatusCode, cut_off_status(ev)), ev.message)
                yield ev
        finally:
            self.hub.close(w)

    def _cancel_later(self, context: grpc.ServicerContext) -> None:
        """A cut-off stream whose sends are blocked never reaches its status: cancel it
        after `stalled_cancel_ms` unless it ended by then (limits.py says why)."""
        t = threading.Timer(self.limits.stalled_cancel_ms / 1000, context.cancel)
        t.daemon = True
        context.add_callback(t.cancel)
        t.start()

    def open(self, req: pb.WatchRequest) -> tuple[Watcher, Iterator[pb.WatchEvent]]:
        """A watcher and the snapshot events to send first (none when resuming).

        Raises validate.BadRequest or watch_hub.Refused (a gRPC status name)."""
        nss = frozenset(validate.namespace_key(ns) for ns in req.namespaces) or None
        if req.from_index:
            w = self.hub.open_from(req.from_index, nss, self._commit_index())
            if w is not None:
                return w, iter(())
        if not self._snapshots.acquire(blocking=False):
            raise Refused(
                "RESOURCE_EXHAUSTED",
                "too-many-snapshots",
                f"{self.limits.snapshots_inflight_max} watch snapshots in flight; retry soon",
            )
        try:
            cap = self._capture()
        except TimeoutError as e:
            raise Refused("UNAVAILABLE", "replica-busy", str(e)) from e
        finally:
            self._snapshots.release()
        # Commands applied since the capture are in the history (it holds far more
        # than one capture's worth), so the watcher starts exactly at `index`.
        index = cap.index
        opened = self.hub.open_from(index, nss, self._commit_index())
        if opened is None:
            with self._capture_lock:
                self._shared = None  # too old for the history: no later start may use it
            raise Refused("UNAVAILABLE", "replica-busy", "commands outran the history; retry")
        try:
            image = cap.image  # the columns are copied here, once per capture
            if nss is not None:  # the watcher gets only what its stream will update
                image = snapshot.restrict(image, nss)
            buf = io.BytesIO()
            snapshot.write_to(buf, image, {}, [])
        except BaseException:
            self.hub.close(opened)
            raise
        return opened, self._chunks(buf.getvalue(), index)

    def _capture(self) -> Capture:
        """A capture for a Watch start: the latest one while another start still
        uses it and it is younger than `snapshot_share_ms`, else a new one. Starts
        that come while one is being taken wait for it and share it (and its copy)."""
        share_s = self.limits.snapshot_share_ms / 1000
        with self._capture_lock:
            if self._shared is not None and time.monotonic() - self._shared[1] < share_s:
                cap = self._shared[0]()
                if cap is not None:
                    return cap
            cap = self.consensus.capture(CAPTURE_TIMEOUT_S)
            self._shared = (weakref.ref(cap), time.monotonic())
            return cap

    def _commit_index(self) -> int:
        return self.consensus.status().commit_index

    def _chunks(self, data: bytes, index: int) -> Iterator[pb.WatchEvent]:
        step = self.limits.snapshot_chunk_bytes
        total = len(data)
        for off in range(0, max(total, 1), step):
            ev = self._event(index)
            ev.snapshot.index, ev.snapshot.total_bytes = index, total
            ev.snapshot.last = off + step >= total
            ev.snapshot.data = data[off : off + step]
            yield ev

    def next_event(self, w: Watcher, wait_s: float) -> pb.WatchEvent | CutOff:
        """The next event for `w`: commands, or a heartbeat after `wait_s` without any."""
        item = self.hub.take(w, wait_s)
        if isinstance(item, CutOff):
            return item
        ev = self._event(item.through)
        if isinstance(item, Batch):
            ev.entries.indexes.extend(e.index for e in item.entries)
            ev.entries.commands.extend(e.blob for e in item.entries)
        else:
            cut = self._leaderless(w)
            if cut is not None:
                return cut
            ev.heartbeat.SetInParent()
        return ev

    def _leaderless(self, w: Watcher) -> CutOff | None:
        """At an idle heartbeat: cut `w` off once this replica has had no leader for
        `leaderless_cut_ms`. A replica removed but left running, or in a minority, has
        no leader and applies nothing more; its heartbeats alone would keep a mirror
        on it, fresh by every measure it has, while the cluster moves on. Counted in
        heartbeats, not read from a clock: the simulator runs this on simulated time."""
        if self.consensus.status().leader is not None:
            w.leaderless = 0
            return None
        w.leaderless += 1
        lim = self.limits
        if w.leaderless * lim.heartbeat_ms < lim.leaderless_cut_ms:
            return None
        return self.hub.cut_off(
            w,
            "no-leader",
            f"this replica has had no leader for {lim.leaderless_cut_ms} ms "
            "(it left the cluster or lost its majority); follow another replica",
        )


def cut_off_status(c: CutOff) -> str:
    """The gRPC status a cut-off watcher gets (the .proto lists them)."""
    return "RESOURCE_EXHAUSTED" if c.reason == "watcher-too-slow" else "UNAVAILABLE"
