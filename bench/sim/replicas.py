"""Real kvdir replicas (`_replica.Replica`) run by hand: the clock, start, tick, crash.

A replica here is the production class with production code paths; what
differs is injected through `_replica.Hooks` (the simulated transport, no
tick thread, the recording `Disk` syncer, background jobs queued for the
simulator) and through pysyncobj's one clock function, which `SimClock.installed`
replaces for the duration of a run (pysyncobj reads `monotonicTime` from its
module; kvdir's replica reads `raft_clock`). The Python `random` module that
pysyncobj and the replica draw election timeouts from is seeded per run, and
pysyncobj's nodes hash the same in every process (`_stable_hash`).

A crash drops the replica object without its clean stop (nothing staged is
written; open files are just closed, as the kernel would), and a power loss
additionally rewinds its data dir to what its `Disk` recorded as synced.
"""

from __future__ import annotations

import contextlib
import os
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pysyncobj.syncobj as pysyncobj_module
from pysyncobj.node import Node

from bench.sim.disk import Disk
from bench.sim.net import Network, transport_class
from kvdir.directory.consensus import _replica
from kvdir.directory.consensus._replica import Hooks, Replica
from kvdir.directory.consensus.sync import Durability
from kvdir.directory.consensus.tuning import RaftTuning

CLUSTER_ID = "sim"
START_S = 1000.0
"""The simulated clock's first reading (pysyncobj divides it into compaction windows)."""


READ_COST_S = 0.0002
"""Simulated time each clock reading costs. pysyncobj bounds some loops only by the
clock (a leader sends to a follower that needs a snapshot in a loop that ends after
`appendEntriesPeriod`): on a clock that stood still they would never end."""


class SimClock:
    """Seconds, advanced by the simulator and by every reading (`READ_COST_S`)."""

    def __init__(self) -> None:
        self.now = START_S

    def __call__(self) -> float:
        t = self.now
        self.now += READ_COST_S
        return t

    @contextlib.contextmanager
    def installed(self, seed: int) -> Iterator[None]:
        """pysyncobj's and the replica's clock read this one; `random` is seeded."""
        module: Any = _replica  # its clock is a module attribute, as pysyncobj's is
        saved = (pysyncobj_module.monotonicTime, module.raft_clock, random.getstate())
        node_hash = Node.__hash__
        pysyncobj_module.monotonicTime = self
        module.raft_clock = self
        Node.__hash__ = _stable_hash
        random.seed(f"sim-random/{seed}")
        try:
            yield
        finally:
            pysyncobj_module.monotonicTime, module.raft_clock, state = saved
            Node.__hash__ = node_hash
            random.setstate(state)


_HASHES: dict[Any, int] = {}
"""Node id -> its stable hash (pysyncobj hashes nodes ~10 times a step: cached)."""


def _stable_hash(node: Any) -> int:
    """pysyncobj keeps nodes in sets and iterates them (sending, counting); a node hashes
    as its address string, whose hash differs per process. A hash of the bytes keeps that
    order, and so every clock reading and message, the same in every process."""
    key = node.id
    h = _HASHES.get(key)
    if h is None:
        h = _HASHES[key] = zlib.crc32(str(key).encode())
    return h


class _NullPoller:
    """pysyncobj polls its sockets at the end of every tick; the simulator has none."""

    def subscribe(self, *_: Any) -> None:
        pass

    def unsubscribe(self, *_: Any) -> None:
        pass

    def poll(self, _timeout: float) -> None:
        pass


class _NullNotifier:
    def notify(self) -> None:
        pass


Job = Callable[[], None]


@dataclass
class SimReplica:
    """One member's seat: its address and data dir outlive each process run in it."""

    address: str
    data_dir: str
    disk: Disk
    replica: Replica | None = None
    incarnation: int = 0
    jobs: list[tuple[int, int, Job]] = field(default_factory=list)
    """(due step, order, job): the dump writer's work, run when its step comes."""
    checked_commit: int = 0
    """The commit index up to which this run's log was compared with the committed log."""
    seen_applied: int = -1
    seen_role: tuple[int, int] = (-1, -1)

    @property
    def up(self) -> bool:
        return self.replica is not None


def start(
    seat: SimReplica,
    peers: list[str],
    tuning: RaftTuning,
    network: Network,
    background: Callable[[SimReplica, Job], None],
    join: bool = False,
) -> Replica:
    """Start a replica in `seat` (loading whatever its data dir holds)."""
    hooks = Hooks(
        transport_class=transport_class(network),
        auto_tick=False,
        syncer=seat.disk.syncer,
        background=lambda job: background(seat, job),
    )
    r = Replica(
        seat.address,
        [p for p in peers if p != seat.address],
        seat.data_dir,
        tuning,
        None,
        CLUSTER_ID,
        join,
        None,
        seat.address,
        Durability.POWER_LOSS,
        hooks,
    )
    _quiet(r)
    r.kvdir_journal.on_failure = _reraise  # the simulator records it and crashes the replica
    seat.replica = r
    seat.incarnation += 1
    seat.checked_commit = 0
    seat.seen_applied = -1
    seat.seen_role = (-1, -1)
    return r


def _reraise(error: BaseException) -> None:
    raise error


def _quiet(r: Replica) -> None:
    """Swap pysyncobj's poller and wake-up pipe (no sockets here) for no-ops."""
    notifier = getattr(r, "_SyncObj__pipeNotifier", None)
    if notifier is not None:
        os.close(notifier._PipeNotifier__pipeR)
        os.close(notifier._PipeNotifier__pipeW)
        r._SyncObj__pipeNotifier = _NullNotifier()
    r._poller = _NullPoller()


def crash(seat: SimReplica, network: Network, power_loss: bool, rng: random.Random) -> list[str]:
    """Stop the process in `seat` at once; with `power_loss`, unsynced writes are gone too."""
    r = seat.replica
    if r is None:
        return []
    journal = r.kvdir_journal
    for owner in (journal.log, journal.terms):
        if owner._fd >= 0:
            os.close(owner._fd)
            owner._fd = -1
    _close_transmissions(r)
    network.detach(seat.address)
    seat.replica = None
    seat.jobs.clear()
    return seat.disk.power_loss(rng) if power_loss else []


def _close_transmissions(r: Replica) -> None:
    """The snapshot files pysyncobj holds open to send or receive (a process's end closes them)."""
    serializer = r._SyncObj__serializer
    for t in serializer._Serializer__transmissions.values():
        if "file" in t:
            t["file"].close()
    serializer._Serializer__transmissions = {}
    incoming = serializer._Serializer__incomingTransmissionFile
    if incoming is not None:
        incoming.close()
        serializer._Serializer__incomingTransmissionFile = None


def stop_clean(seat: SimReplica) -> None:
    """The end of a run: close files the way a clean stop does."""
    r = seat.replica
    if r is not None:
        _close_transmissions(r)
        r._doDestroy()
        seat.replica = None
        seat.jobs.clear()


def crash_note(seat: SimReplica, network: Network, power: bool, rng: random.Random) -> str:
    """`crash`, and the trace line that says what it did."""
    lost = crash(seat, network, power, rng)
    what = f"power loss (lost {', '.join(lost) or 'no file'})" if power else "crash"
    return f"{seat.address} {what}"


def leader_of(seats: dict[str, SimReplica]) -> str | None:
    """The running replica that leads the highest term (the newest leader), if any."""
    best: tuple[int, str] | None = None
    for addr, seat in sorted(seats.items()):
        r = seat.replica
        if r is not None and r.role() == 2:
            cand = (int(r.raftCurrentTerm), addr)
            best = cand if best is None or cand > best else best
    return None if best is None else best[1]


def close(seat: SimReplica) -> None:
    """Stop a replica cleanly at the end of a run, whatever state the run left it in."""
    try:
        stop_clean(seat)
    except Exception:  # a replica broken by the run must not hide the run's result
        seat.replica = None


__all__ = [
    "CLUSTER_ID",
    "SimClock",
    "SimReplica",
    "close",
    "crash",
    "crash_note",
    "leader_of",
    "start",
    "stop_clean",
]
