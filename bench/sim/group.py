"""One Raft group of the multi-group simulator (`groups`): real replicas on the run's clock.

The single-group `simulation.Simulation` owns its clock; here several groups
share one clock, each with a `Network` of its own. Groups never exchange Raft
messages (a replica's peers are its own group's), so one network per group is
the run's whole network with its links sorted by group; it also makes every
network fault (loss, delay, a partition and its heal) a fault of one group,
which is what `faults.maybe_fault` injects when it runs on a group. A
`SimGroup` implements `cluster.Cluster`, so the single-group faults and
`ending.converged` run on it unchanged.

Besides Raft, each replica carries what the product's server adds in front of
it for shards: a `ShardView` (directory/shard_view.py, the production class)
that refuses a key its group does not own under the newest map it knows. On
g0 the view follows the replica's own applied table; elsewhere a refresher
offers it the map a g0 replica holds, every `REFRESH_STEPS` (every
`REFRESH_NONE_STEPS` while it has none), and at once when a request carries a
newer version (as shard_service.py does). A restarted replica starts with no
map, as a restarted process does. And each replica has its production Watch
service, which the mover reads a moving shard's source through.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable

from bench.sim import replicas as rp
from bench.sim.checks import Invariants, check_seat, watch_cuts
from bench.sim.disk import Disk
from bench.sim.knobs import Knobs
from bench.sim.membership import Membership
from bench.sim.mirrors import HeldConsensus
from bench.sim.net import Network
from bench.sim.workload import Workload
from kvdir.core.shard_map import ShardMap
from kvdir.directory.commands import Command
from kvdir.directory.consensus.port import WriteResult
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.limits import WatchLimits
from kvdir.directory.shard_view import HOME_GROUP, ShardView
from kvdir.directory.watch import WatchService

REFRESH_STEPS = 100
"""A non-home replica's map refresh period (shard_refresh_ms = 1 s, in 10 ms steps)."""
REFRESH_NONE_STEPS = 10
"""... while it has no map (0.1 s)."""
WATCH_LIMITS = WatchLimits(snapshot_share_ms=0)
"""The production limits; sharing a capture is timed on the wall clock, so never here."""

Done = Callable[[WriteResult, int], None]
"""A proposal's outcome and, when committed, the proposer's applied index at its apply."""


class SimGroup:
    """Replicas of one group, their views and Watch services (see the module docstring)."""

    def __init__(
        self,
        gid: str,
        index: int,
        seed: int,
        root: str,
        clock: rp.SimClock,
        note: Callable[[str], None],
        violation: Callable[[str, str], None],
        disk_lies: bool = False,
        knobs: Knobs | None = None,
    ) -> None:
        self.gid = gid
        self.home = gid == HOME_GROUP
        self.rng = random.Random(f"groups/{seed}/{gid}")
        drawn = Knobs.draw(self.rng)
        # Membership changes stay out (their rate is 0): one change at a time per
        # group is the single-group sim's business; here the shards' moves are.
        self.knobs = dataclasses.replace(knobs or drawn, membership=0.0)
        self.addresses = [f"127.0.0.1:{7001 + 100 * index + i}" for i in range(3)]
        self.members = Membership.of(seed, self.addresses)
        self.clock = clock
        self.net = Network(seed * 1000 + index, self.knobs.net, clock)
        self.disk_lies = disk_lies
        self.step = 0
        self.work = Workload(owners=0, keys_per_owner=0, rng=random.Random(0))
        """Unused and empty (the clients are the run's, over every group); here because
        `ending.converged` asks a cluster whether its clients still wait."""
        self._note, self._violation = note, violation
        self.inv = Invariants(self.violation)
        self.tuning = RaftTuning(
            compaction_min_entries=self.knobs.compaction_min_entries,
            compaction_min_time_s=self.knobs.compaction_min_time_s,
        )
        self.seats: dict[str, rp.SimReplica] = {}
        for addr in self.addresses:
            d = os.path.join(root, gid, addr.rsplit(":", 1)[1])
            os.makedirs(d, exist_ok=True)
            self.seats[addr] = rp.SimReplica(addr, d, Disk(d, lies=disk_lies))
        self.views: dict[str, ShardView] = {}
        self.refresh_at: dict[str, int] = {}
        self.watch: dict[str, tuple[int, WatchService]] = {}
        self.consensus: dict[str, HeldConsensus] = {}
        self._job_order = 0

    # ------------------------------------------------------------------ trace

    def note(self, text: str) -> None:
        self._note(f"{self.gid} {text}")

    def violation(self, kind: str, detail: str) -> None:
        self._violation(kind, f"{self.gid}: {detail}")

    # ------------------------------------------------------------ replicas

    def start(self, addr: str, peers: list[str] | None = None, join: bool = False) -> None:
        seat = self.seats[addr]
        peers = peers or sorted(self.members.members)
        try:
            r = rp.start(seat, peers, self.tuning, self.net, self._background, join)
        except Exception as e:
            self.violation("start_failed", f"{addr}: {type(e).__name__}: {e}"[:300])
            return

        def on_cut(index: int) -> None:
            self.note(f"{addr} cuts its log from {index} (commit {int(r.raftCommitIndex)})")
            self.inv.cut(addr, r, index)

        def on_apply(index: int, _cmd: object, _res: object) -> None:
            self.inv.applied(addr, index, r.entry_at(index))

        watch_cuts(r, on_cut)
        r.add_listener(on_apply, None)
        consensus = self.consensus[addr] = HeldConsensus(r, rp.CLUSTER_ID)
        svc = WatchService(consensus, addr, WATCH_LIMITS)
        svc.attach()  # before its first tick, as the daemon attaches it
        self.watch[addr] = (seat.incarnation, svc)
        self.views[addr] = ShardView(self.gid, sharded=True)  # a new process knows no map
        self.refresh_at[addr] = self.step + REFRESH_NONE_STEPS
        self.note(f"{addr} started (run {seat.incarnation})")

    def crash(self, addr: str, power: bool) -> None:
        self.note(rp.crash_note(self.seats[addr], self.net, power, self.rng))

    def leader(self) -> str | None:
        return rp.leader_of(self.seats)

    def running(self) -> list[str]:
        return [a for a in sorted(self.seats) if self.seats[a].up]

    def alive(self, addr: str, incarnation: int) -> bool:
        s = self.seats[addr]
        return s.up and s.incarnation == incarnation

    def _background(self, seat: rp.SimReplica, job: rp.Job) -> None:
        self._job_order += 1
        due = self.step + self.rng.randint(0, self.knobs.dump_delay_steps_max)
        seat.jobs.append((due, self._job_order, job))
        seat.jobs.sort()

    # ------------------------------------------------------------ one step

    def tick(self) -> None:
        """Due messages reach each running replica (in a seeded order), then its tick;
        then the background jobs whose step came (as `Simulation._step`)."""
        self.net.refresh()
        due = self.net.due(self.clock.now)
        order = sorted(self.seats)
        self.rng.shuffle(order)
        for addr in order:
            seat = self.seats[addr]
            r = seat.replica
            if r is None:
                continue
            t = self.net.transports.get(addr)
            for src, data in due.get(addr, []):
                try:
                    if t is not None:
                        t.deliver(src, data)
                except Exception as e:  # pysyncobj would log "failed _onTick" and go on
                    self._tick_error(addr, "message", e)
            try:
                r._onTick(0.0)
            except Exception as e:
                self._tick_error(addr, "tick", e)
        for seat in self.seats.values():
            while seat.jobs and seat.jobs[0][0] <= self.step:
                _, _, job = seat.jobs.pop(0)
                job()

    def _tick_error(self, addr: str, where: str, e: Exception) -> None:
        self.violation("tick_error", f"{addr} {where}: {type(e).__name__}: {e}"[:300])

    def check(self, final: bool, digest_every: int) -> None:
        """The single-group invariants (`checks.Invariants`) over this group's replicas."""
        sample = final or self.step % digest_every == 0
        for addr in sorted(self.seats):
            if self.seats[addr].replica is not None:
                check_seat(self.inv, addr, self.seats[addr], sample, self.note)

    # ------------------------------------------------------------ requests

    def propose(self, addr: str, cmd: Command, done: Done) -> None:
        """`cmd` through the entry the server uses (`RaftConsensus.propose`: a write is
        taken by the leader only, a Barrier may be forwarded); `done` gets the outcome
        and, when committed, the index it was applied at on this replica."""
        consensus = self.consensus[addr]

        def back(res: WriteResult) -> None:
            # pysyncobj calls back while applying the entry, before it counts it applied.
            live = self.seats[addr].replica
            done(res, 0 if live is None else int(live.raftLastApplied) + 1)

        consensus.propose(cmd, back)

    def leader_named(self, addr: str) -> str:
        """The leader `addr` knows of (what a refusal names), or ""."""
        r = self.seats[addr].replica
        leader = None if r is None else r._getLeader()
        return "" if leader is None else str(leader.address)

    def view(self, addr: str, fetch: Callable[[], ShardMap | None], version: int) -> ShardView:
        """`addr`'s view as a request carrying map `version` finds it (shard_service.py:
        a caller's newer version makes the replica refresh first)."""
        v = self.views[addr]
        if self.home:
            r = self.seats[addr].replica
            if r is not None and r.table.shard_map is not None:
                v.offer(r.table.shard_map)  # g0 follows its own applied log
        elif version > v.version:
            m = fetch()
            if m is not None:
                v.offer(m)
        return v

    def refresh(self, fetch: Callable[[], ShardMap | None]) -> None:
        """The non-home replicas' periodic refresher."""
        if self.home:
            return
        for addr in self.running():
            if self.step < self.refresh_at.get(addr, 0):
                continue
            v = self.views[addr]
            m = fetch()
            if m is not None and v.offer(m):
                self.note(f"{addr} routes by shard map v{m.version}")
            self.refresh_at[addr] = self.step + (REFRESH_STEPS if v.version else REFRESH_NONE_STEPS)


__all__ = ["REFRESH_STEPS", "SimGroup"]
