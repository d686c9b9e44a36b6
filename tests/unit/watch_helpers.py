"""A replica of the in-process consensus (MemoryCluster) feeding a real WatchService.

`LocalReplica` is a two-member MemoryCluster: commands go through the leader
and the watched member applies them and calls the watch listener where the
port says (after the apply, before the applied index counts it). Barriers
stand in for Raft's no-op entries (indexes a mirror never sees), and holding
the watched member gives it a commit index ahead of its applied one.
"""

from __future__ import annotations

from kvdir.core.mirror import Mirror
from kvdir.directory import codec
from kvdir.directory.commands import Barrier, Command
from kvdir.directory.consensus.memory import MemoryCluster, MemoryReplica
from kvdir.directory.consensus.port import Outcome
from kvdir.directory.limits import WatchLimits
from kvdir.directory.table import Table
from kvdir.directory.watch import WatchService
from kvdir.directory.watch_hub import CutOff, Watcher
from kvdir.v1 import directory_pb2 as pb

LEADER, WATCHED = "mem-1:1", "mem-2:1"
WRITE_TIMEOUT_S = 1.0


class LocalReplica:
    def __init__(self, limits: WatchLimits | None = None) -> None:
        self.cluster = MemoryCluster((LEADER, WATCHED))
        self.consensus: MemoryReplica = self.cluster[WATCHED]
        self.service = WatchService(self.consensus, "local", limits or WatchLimits())
        self.service.attach()

    @property
    def index(self) -> int:
        return self.consensus.applied

    @property
    def commit(self) -> int:
        return self.consensus.status().commit_index

    @property
    def table(self) -> Table:
        return self.consensus.table

    def write(self, cmd: Command) -> None:
        res = self.cluster[LEADER].write(cmd, WRITE_TIMEOUT_S)
        assert res.outcome is Outcome.COMMITTED, res

    def apply(self, blob: bytes, skip: int = 0) -> None:
        for _ in range(skip):
            self.noop()
        self.write(codec.decode(blob))

    def noop(self) -> None:
        """A log entry that changes no table (as Raft's no-op and membership entries)."""
        self.write(Barrier())

    def hold(self) -> None:
        """The watched member stops applying: commits run ahead of it."""
        self.cluster.hold(WATCHED)

    def release(self) -> None:
        self.cluster.release(WATCHED)


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
