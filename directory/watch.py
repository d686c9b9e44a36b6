"""The Watch RPC of a replica: its committed log as a stream (the .proto has the contract).

A stream starts either from the hub's history (the caller's `from_index` is
still covered) or from a snapshot captured between two applies, atomically
with the watcher's registration, then relays what the hub queues for it, and
a heartbeat when nothing came for `heartbeat_ms`. Every event carries the
replica's applied and commit index, so a mirror knows how far behind it is.

The work on the apply path is `observe` (one reference appended per
watcher); everything else (snapshot encoding, messages) runs on the stream's
own gRPC thread.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import grpc

from kvdir.directory import codec, snapshot, validate
from kvdir.directory.commands import (
    Barrier,
    ClearNode,
    Command,
    Publish,
    Rejected,
    Remove,
    Result,
)
from kvdir.directory.limits import WatchLimits
from kvdir.directory.watch_hub import Batch, CutOff, Refused, Watcher, WatchHub
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.directory.watch")

T = TypeVar("T")
CAPTURE_TIMEOUT_S = 5.0
"""Longest a new watcher waits for the apply thread to capture its snapshot."""


class Feed(Protocol):
    """What Watch needs from a replica."""

    def applied_index(self) -> int: ...

    def commit_index(self) -> int: ...

    def capture(self, then: Callable[[int], T], timeout_s: float) -> tuple[snapshot.Image, T]:
        """The table's image between two applies, and `then(index)` run at that same point."""
        ...


def namespace_of(cmd: Command) -> str | None:
    """The namespace a command touches; None for node-wide commands."""
    if isinstance(cmd, Publish | Remove):
        return cmd.namespace
    if isinstance(cmd, ClearNode) and not cmd.deregister:
        return cmd.namespace
    return None


def changes_table(cmd: Command, result: Result) -> bool:
    """Whether a mirror must apply this command (refused ones and barriers change nothing)."""
    return not isinstance(cmd, Barrier) and not isinstance(result, Rejected)


class WatchService:
    def __init__(
        self, feed: Feed, replica_id: str, limits: WatchLimits, start_index: int = 0
    ) -> None:
        self.feed = feed
        self.replica_id = replica_id
        self.limits = limits
        self.hub = WatchHub(limits, feed.applied_index, start_index)
        self._snapshots = threading.BoundedSemaphore(limits.snapshots_inflight_max)

    def observe(self, index: int, blob: bytes, cmd: Command, result: Result) -> None:
        """The apply listener: call after each applied command, before its index counts."""
        if changes_table(cmd, result):
            self.hub.committed(index, blob, namespace_of(cmd))

    def _event(self, applied: int) -> pb.WatchEvent:
        return pb.WatchEvent(
            applied_index=applied,
            commit_index=max(self.feed.commit_index(), applied),
            replica_id=self.replica_id,
            command_version=codec.VERSION,
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

    def open(self, req: pb.WatchRequest) -> tuple[Watcher, Iterator[pb.WatchEvent]]:
        """A watcher and the snapshot events to send first (none when resuming).

        Raises validate.BadRequest or watch_hub.Refused (a gRPC status name)."""
        nss = frozenset(validate.namespace_key(ns) for ns in req.namespaces) or None
        if req.from_index:
            w = self.hub.open_from(req.from_index, nss, self.feed.commit_index())
            if w is not None:
                return w, iter(())
        if not self._snapshots.acquire(blocking=False):
            raise Refused(
                "RESOURCE_EXHAUSTED",
                "too-many-snapshots",
                f"{self.limits.snapshots_inflight_max} watch snapshots in flight; retry soon",
            )
        try:
            image, opened = self.feed.capture(
                lambda idx: self.hub.open_at(idx, nss), CAPTURE_TIMEOUT_S
            )
        except TimeoutError as e:
            raise Refused("UNAVAILABLE", "replica-busy", str(e)) from e
        finally:
            self._snapshots.release()
        try:
            buf = io.BytesIO()
            snapshot.write_to(buf, image, {}, [])
        except BaseException:
            self.hub.close(opened)
            raise
        return opened, self._chunks(buf.getvalue(), opened.after)

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
            ev.heartbeat.SetInParent()
        return ev


def cut_off_status(c: CutOff) -> str:
    """The gRPC status a cut-off watcher gets (the .proto lists them)."""
    return "RESOURCE_EXHAUSTED" if c.reason == "watcher-too-slow" else "UNAVAILABLE"
