"""A replica's apply path without Raft, feeding a real WatchService (unit tier).

`LocalReplica` applies encoded commands to a `Table` at increasing log
indexes (optionally skipping indexes, as Raft's no-op and membership entries
do) and calls the watch listener exactly where the Raft adapter does: after
the apply, before the applied index counts it.
"""

from __future__ import annotations

import threading

from kvdir.core.mirror import Mirror
from kvdir.directory import codec, snapshot
from kvdir.directory.limits import WatchLimits
from kvdir.directory.table import Table
from kvdir.directory.watch import WatchService
from kvdir.directory.watch_hub import CutOff, Watcher
from kvdir.v1 import directory_pb2 as pb


class LocalReplica:
    def __init__(self, limits: WatchLimits | None = None) -> None:
        self.table = Table()
        self.lock = threading.Lock()
        self.index = 0
        self.commit = 0
        self.service = WatchService(self, "local", limits or WatchLimits())

    def applied_index(self) -> int:
        return self.index

    def commit_index(self) -> int:
        return self.commit

    def capture(self, timeout_s: float) -> tuple[snapshot.Image, int]:
        with self.lock:
            return snapshot.capture(self.table), self.index

    def apply(self, blob: bytes, skip: int = 0) -> None:
        index = self.index + 1 + skip
        cmd = codec.decode(blob)
        with self.lock:
            res = self.table.apply(cmd)
        self.service.observe(index, blob, cmd, res)
        self.index = index
        self.commit = max(self.commit, index)

    def noop(self) -> None:
        """A Raft entry that is no command (an election's no-op)."""
        self.index = self.commit = self.index + 1


class Stream:
    """One watcher's stream, drained by hand into a mirror."""

    def __init__(self, replica: LocalReplica, mirror: Mirror, req: pb.WatchRequest) -> None:
        self.replica = replica
        self.mirror = mirror
        self.watcher: Watcher
        self.watcher, chunks = replica.service.open(req)
        for ev in chunks:
            mirror.on_event(ev)

    def drain(self, max_events: int = 10_000) -> CutOff | None:
        """Deliver everything queued, then one heartbeat; a cut-off is returned."""
        for _ in range(max_events):
            ev = self.replica.service.next_event(self.watcher, 0.0)
            if isinstance(ev, CutOff):
                return ev
            self.mirror.on_event(ev)
            if ev.WhichOneof("event") == "heartbeat":
                return None
        raise AssertionError("the stream never went idle")

    def close(self) -> None:
        self.replica.service.hub.close(self.watcher)


def connect(
    replica: LocalReplica, mirror: Mirror, namespaces: list[pb.Namespace] | None = None
) -> Stream:
    req = pb.WatchRequest(from_index=mirror.resume_index(), namespaces=namespaces or [])
    return Stream(replica, mirror, req)
