"""A real mirror fed by the replicas' real Watch feeds, inside the simulation.

Each replica gets the production Watch service when it starts, as the daemon
attaches it (`WatchService` over the replica's `RaftConsensus`, its `WatchHub`
on the apply path). One `kvdir.core.mirror.Mirror` follows one replica at a
time, as `MirrorSync` does over gRPC: it opens a stream (`WatchService.open`)
from `Mirror.resume_index()`, takes what the hub queued for it
(`WatchService.next_event`, with no wait: the simulator is the only thread)
and hands every event to `Mirror.on_event`. When its replica crashes or is
removed, refuses it, or cuts it off (a snapshot install; too slow), it
resumes on the next replica (the same one after "too slow"), from its index
or, when that replica's history no longer covers it, from a snapshot; after
a refusal it waits as `MirrorSync` does (doubling pauses, in simulated time).

The mirror's own random stream (`mirror/<seed>`) decides how slow it is,
how short the replicas' Watch history is (so resuming needs a snapshot
often) and when it moves to another replica unasked; the replicas never
see that stream, and the mirror reads the simulated clock without advancing
it, so a seed's Raft run is the same with or without the mirror.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvdir.core.mirror import Mirror, MirrorError, Resync
from kvdir.core.mirror_sync import RETRY_S_MAX, RETRY_S_MIN
from kvdir.directory.consensus._replica import Replica
from kvdir.directory.consensus.port import Capture
from kvdir.directory.consensus.syncobj import RaftConsensus
from kvdir.directory.limits import WatchLimits
from kvdir.directory.watch import WatchService
from kvdir.directory.watch_hub import CutOff, Refused, Watcher
from kvdir.v1 import directory_pb2 as pb

EVENTS_PER_STEP_MAX = 64
"""Events a mirror takes in one step (a burst beyond it waits for the next step)."""
FINAL_PUMPS_MAX = 50
"""After healing: rounds the mirror gets to catch up with the quiet cluster."""

Tamper = Callable[[pb.WatchEvent], pb.WatchEvent]
"""Tests only: changes an event before the mirror sees it (the checks must notice)."""


class HeldConsensus(RaftConsensus):
    """`RaftConsensus` over a replica the simulator started (its own __init__ starts one)."""

    def __init__(self, replica: Replica, cluster_id: str) -> None:
        # RaftConsensus.__init__ is not called: it would start a second replica.
        self._r = replica
        self._cluster_id = cluster_id
        self._barrier_lock = threading.Lock()
        self._barrier_inflight = None
        self._barrier_next = None

    def capture(self, timeout_s: float) -> Capture:
        """The production capture, its tick callback run at once: the simulator calls
        this between two ticks, which is where pysyncobj runs tick callbacks."""
        r: Any = self._r
        r.addOnTickCallback = lambda fn: fn()
        r.removeOnTickCallback = lambda fn: None
        try:
            return super().capture(timeout_s)
        finally:
            del r.addOnTickCallback, r.removeOnTickCallback


@dataclass(frozen=True, slots=True)
class MirrorKnobs:
    stall: float
    """Per step: the chance the mirror reads nothing (a slow reader)."""
    wander: float
    """Per step: the chance it drops its stream and resumes on the next replica."""
    history_entries_max: int
    """The replicas' Watch history (short: resuming often needs a snapshot)."""

    @classmethod
    def draw(cls, rng: random.Random) -> MirrorKnobs:
        return cls(
            stall=rng.choice([0.0, 0.1, 0.5]),
            wander=rng.choice([0.0, 0.002, 0.01]),
            history_entries_max=rng.choice([4, 16, WatchLimits().history_entries_max]),
        )

    def limits(self) -> WatchLimits:
        h = self.history_entries_max
        # watch_hub asserts history <= buffer; a buffer of 4x the history makes a
        # stalled mirror get cut off as too slow now and then.
        # snapshot_share_ms=0: sharing a capture is timed on the wall clock.
        return WatchLimits(history_entries_max=h, buffer_entries_max=4 * h, snapshot_share_ms=0)


@dataclass
class _Stream:
    address: str
    incarnation: int
    service: WatchService
    watcher: Watcher
    first: Iterator[pb.WatchEvent]
    """The snapshot's events, sent before anything the hub queued."""


class SimMirror:
    """The mirror and the stream it follows (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        clock: Callable[[], float],
        note: Callable[[str], None],
        violation: Callable[[str, str], None],
        tamper: Tamper | None = None,
        knobs: MirrorKnobs | None = None,
    ) -> None:
        self.rng = random.Random(f"mirror/{seed}")
        drawn = MirrorKnobs.draw(self.rng)
        self.knobs = knobs or drawn
        self.limits = self.knobs.limits()
        self.mirror = Mirror(max_staleness_s=1e9, clock=clock)
        self.clock = clock
        self.retry_at = 0.0
        self.pause_s = RETRY_S_MIN
        self.sent_at = 0.0
        """When the stream last sent an event (simulated time)."""
        self.services: dict[str, tuple[int, WatchService]] = {}
        self.stream: _Stream | None = None
        self.next_at = ""
        """The replica the next stream opens on ("" before any)."""
        self._note, self._violation, self._tamper = note, violation, tamper
        self.events = self.streams = 0

    def attach(self, address: str, incarnation: int, replica: Replica, cluster_id: str) -> None:
        """A replica started: its Watch service, attached before its first tick."""
        svc = WatchService(HeldConsensus(replica, cluster_id), address, self.limits)
        svc.attach()
        self.services[address] = (incarnation, svc)

    def step(self, running: dict[str, int], quiet: bool = False) -> None:
        """One step: `running` maps each running replica to its incarnation. `quiet`:
        no stalls, moves or pauses (the end of a run, catching up)."""
        s = self.stream
        if s is not None and running.get(s.address) != s.incarnation:
            self._note(f"mirror: lost its stream from {s.address} (the replica is gone)")
            self._end(advance=True, close=False)
        elif s is not None and not quiet and self.rng.random() < self.knobs.wander:
            self._note(f"mirror: leaves {s.address}")
            self._end(advance=True)
        if not quiet and self.rng.random() < self.knobs.stall:
            return
        if quiet:
            self.retry_at = 0.0  # catching up at the end: the cluster is quiet, no back-off
        if self.stream is None and not self._open(running):
            return
        self._pump(quiet)

    def _open(self, running: dict[str, int]) -> bool:
        order = sorted(running)
        if not order or self.clock() < self.retry_at:
            return False
        addr = self.next_at if self.next_at in running else order[0]
        inc, svc = self.services[addr]
        if inc != running[addr]:
            return False
        req = pb.WatchRequest(from_index=self.mirror.resume_index())
        try:
            w, first = svc.open(req)
        except Refused as e:
            self._note(f"mirror: {addr} refuses from {req.from_index}: {e.code} {e.reason}")
            self.next_at = _after(order, addr)
            self.retry_at = self.clock() + self.pause_s
            self.pause_s = min(RETRY_S_MAX, self.pause_s * 2)
            return False
        self.streams += 1
        self.pause_s = RETRY_S_MIN
        self._note(f"mirror: follows {addr} from {req.from_index} (at {w.handed})")
        self.stream = _Stream(addr, inc, svc, w, first)
        self.next_at = addr
        return True

    def _pump(self, quiet: bool) -> None:
        s = self.stream
        assert s is not None
        w, heartbeat_s = s.watcher, self.limits.heartbeat_ms / 1000
        for _ in range(EVENTS_PER_STEP_MAX):
            ev = next(s.first, None)
            if ev is None:
                # As the stream's `take` would: nothing is sent before there is
                # something queued or a heartbeat is due (always, when catching up).
                idle = not w.buffer and w.cut is None
                if idle and not quiet and self.clock() - self.sent_at < heartbeat_s:
                    return
                item = s.service.next_event(s.watcher, 0.0)
                if isinstance(item, CutOff):
                    self._note(f"mirror: cut off by {s.address}: {item.reason}")
                    self._end(advance=item.reason != "watcher-too-slow")
                    return
                ev = item
            self.sent_at = self.clock()
            if not self._feed(ev):
                return
            if ev.HasField("heartbeat"):
                return  # nothing more queued for it now

    def _feed(self, ev: pb.WatchEvent) -> bool:
        if self._tamper is not None:
            ev = self._tamper(ev)
        self.events += 1
        loaded = self.mirror.snapshots
        try:
            self.mirror.on_event(ev)
        except (MirrorError, Resync) as e:
            self._violation("mirror_error", f"{ev.replica_id}: {type(e).__name__}: {e}"[:300])
            self._end(advance=True)
            return False
        if self.mirror.snapshots != loaded:
            self._note(f"mirror: loaded {ev.replica_id}'s snapshot at {self.mirror.applied_index}")
        return True

    def _end(self, advance: bool, close: bool = True) -> None:
        s = self.stream
        assert s is not None
        if close:
            s.service.hub.close(s.watcher)
        self.stream = None
        if advance:
            self.next_at = _after(sorted(self.services), s.address)

    def source(self) -> tuple[str, int] | None:
        """(replica, incarnation) the mirror follows now."""
        s = self.stream
        return None if s is None else (s.address, s.incarnation)


def _after(order: list[str], addr: str) -> str:
    later = [a for a in order if a > addr]
    return later[0] if later else order[0]


__all__ = ["FINAL_PUMPS_MAX", "HeldConsensus", "MirrorKnobs", "SimMirror", "Tamper"]
