"""One seeded run: N real replicas, a seeded network and disk, faults, clients, checks.

A step is one tick period of simulated time: the clock advances, due
messages reach each running replica (in a seeded order) followed by its Raft
tick, as pysyncobj's loop does (poll, then tick); queued background jobs (the
dump writer) whose step came run; the mirror reads its Watch stream
(`mirrors`); every invariant (`checks`) is checked; then the seed may inject
one fault (`faults`) and start client operations (`workload`).

After the last step the run heals and ends (`ending`): the network is made
whole and clean, every replica restarts, and the run goes on until all
replicas applied the leader's commit index (or `HEAL_STEPS_MAX` steps pass:
"stuck"); the mirror then catches up; then the history is checked.

Everything is decided by the seed; the trace (`Result.trace`) of a seed is
identical on every replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator

from bench.sim import ending, faults
from bench.sim import replicas as rp
from bench.sim.checks import Invariants, MirrorChecks, Violation, check_seat, watch_cuts
from bench.sim.disk import Disk
from bench.sim.knobs import Knobs, Result
from bench.sim.membership import Membership
from bench.sim.mirrors import FINAL_PUMPS_MAX, MirrorKnobs, SimMirror, Tamper
from bench.sim.net import NetFaults, Network
from bench.sim.workload import Workload
from kvdir.directory.consensus.tuning import RaftTuning

TICK_S = 0.01
HEAL_STEPS_MAX = 3000
"""After the faults: steps (of TICK_S) allowed for every replica to catch up."""
DIGEST_EVERY_STEPS = 50
"""Table digests are compared every this many steps (a digest reads the whole table)."""
SHM = "/dev/shm"


class LogCounter(logging.Handler):
    """Counts warnings and errors the replicas log (pysyncobj's 'failed' lines among them)."""

    def __init__(self, logged: dict[str, int]) -> None:
        super().__init__(logging.WARNING)
        self.logged = logged
        """Lines by logger name (a run's `logged`)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.logged[record.name] = self.logged.get(record.name, 0) + 1


class Simulation:
    """One seeded run; implements `cluster.Cluster` for the parts it drives."""

    def __init__(
        self,
        seed: int,
        steps: int,
        replicas: int = 3,
        knobs: Knobs | None = None,
        disk_lies: bool = False,
        tamper: Tamper | None = None,
        mirror_knobs: MirrorKnobs | None = None,
        retries: bool = True,
    ) -> None:
        """`knobs`: fixed rates instead of the seed's; `disk_lies`: syncs record nothing
        (a disk that loses everything at a power cut: the checks must then catch lost
        writes, which is how the tests know they can fail); `tamper`: changes each
        Watch event before the mirror sees it (the mirror checks must then fail);
        `mirror_knobs`: the mirror's rates instead of the seed's; `retries`: clients
        retry as kvdir's client does (`workload`); off, an operation is one attempt."""
        self.seed, self.steps, self.n = seed, steps, replicas
        self.rng = random.Random(f"sim/{seed}")
        drawn = Knobs.draw(self.rng)
        self.addresses = [f"127.0.0.1:{7001 + i}" for i in range(replicas)]
        self.members = Membership.of(seed, self.addresses)
        drawn = dataclasses.replace(drawn, membership=self.members.draw_rate())
        self.knobs = knobs or drawn
        self.disk_lies = disk_lies
        self.clock = rp.SimClock()
        self.net = Network(seed, self.knobs.net, self.clock)
        self.step = 0
        self.result = Result(seed, steps, replicas)
        self.trace = self.result.trace
        self.inv = Invariants(self.violation)
        self.logged: dict[str, int] = {}
        self.tuning = RaftTuning(
            compaction_min_entries=self.knobs.compaction_min_entries,
            compaction_min_time_s=self.knobs.compaction_min_time_s,
        )
        self._tmp = ""
        self.seats: dict[str, rp.SimReplica] = {}
        self.work = Workload(
            owners=3,
            keys_per_owner=4,
            rng=random.Random(f"ops/{seed}"),
            retries=retries,
            now=lambda: self.clock.now,  # read without the cost a reading adds
        )
        self._job_order = 0
        self.max_commit = 0
        """The largest commit index any replica has reached (what no mirror may pass)."""
        # The mirror reads the clock without advancing it (each reading of `clock()`
        # costs simulated time, which would change the replicas' run).
        self.mirror = SimMirror(
            seed, lambda: self.clock.now, self.note, self.violation, tamper, mirror_knobs
        )
        self.mirror_checks = MirrorChecks(self.violation)
        self._mirror_seen = -1
        self.mirror_digests = 0
        """Times the mirror's digest was compared with a replica's."""

    # ------------------------------------------------------------------ trace

    def note(self, text: str) -> None:
        self.trace.append(f"{self.step:5d} {text}")

    def violation(self, kind: str, detail: str) -> None:
        v = Violation(kind, self.step, detail)
        self.result.violations.append(v)
        self.note(f"VIOLATION {v.kind}: {detail}")

    # ------------------------------------------------------------------ run

    def run(self) -> Result:
        t0 = time.process_time()
        self._tmp = tempfile.mkdtemp(prefix="kvdir-sim-", dir=tmp_root())
        try:
            with logs_counted(self.logged), self.clock.installed(self.seed):
                self._run()
        finally:
            for seat in self.seats.values():
                rp.close(seat)
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.result.seconds = time.process_time() - t0
        return self.result

    def _run(self) -> None:
        self.note(f"knobs {self.knobs}")
        self.note(f"mirror knobs {self.mirror.knobs}")
        for addr in self.addresses:
            d = f"{self._tmp}/{addr.rsplit(':', 1)[1]}"
            os.makedirs(d, exist_ok=True)
            self.seats[addr] = rp.SimReplica(addr, d, Disk(d, lies=self.disk_lies))
            self.start(addr)
        for _ in range(self.steps):
            self._step(faults=True)
        self._heal()

    def _step(self, faults: bool) -> None:
        self.step += 1
        self.clock.now += TICK_S
        self.net.refresh()
        due = self.net.due(self.clock.now)
        order = sorted(self.seats)
        self.rng.shuffle(order)
        for addr in order:
            seat = self.seats[addr]
            if seat.replica is None:
                continue
            for src, data in due.get(addr, []):
                self._deliver(seat, src, data)
            self._tick(seat)
        self._run_jobs()
        self.mirror.step(self._running(), quiet=not faults)
        self._check()  # before any fault: a replica that crashes now was seen as it was
        if faults:
            self._maybe_fault()
        self._client(faults)

    def _running(self) -> dict[str, int]:
        return {a: s.incarnation for a, s in self.seats.items() if s.replica is not None}

    def _deliver(self, seat: rp.SimReplica, src: str, data: bytes) -> None:
        t = self.net.transports.get(seat.address)
        if t is None:
            return
        try:
            t.deliver(src, data)
        except Exception as e:  # pysyncobj would log "failed _onTick" and go on
            self._tick_error(seat, "message", e)

    def _tick(self, seat: rp.SimReplica) -> None:
        r = seat.replica
        if r is None:
            return
        try:
            r._onTick(0.0)
        except Exception as e:
            self._tick_error(seat, "tick", e)

    def _tick_error(self, seat: rp.SimReplica, where: str, e: Exception) -> None:
        self.violation("tick_error", f"{seat.address} {where}: {type(e).__name__}: {e}"[:300])

    def _run_jobs(self) -> None:
        for seat in self.seats.values():
            while seat.jobs and seat.jobs[0][0] <= self.step:
                _, _, job = seat.jobs.pop(0)
                job()

    def _background(self, seat: rp.SimReplica, job: rp.Job) -> None:
        self._job_order += 1
        due = self.step + self.rng.randint(0, self.knobs.dump_delay_steps_max)
        seat.jobs.append((due, self._job_order, job))
        seat.jobs.sort()
        self.note(f"{seat.address} dump writer queued for step {due}")

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
            self.note(
                f"{addr} cuts its log from {index} (last {r.last_log_index()}, "
                f"commit {int(r.raftCommitIndex)})"
            )
            self.inv.cut(addr, r, index)

        def on_install(index: int) -> None:
            self.note(f"{addr} loaded a snapshot up to {index}")

        def on_apply(index: int, _cmd: object, _res: object) -> None:
            self.inv.applied(addr, index, r.entry_at(index))

        watch_cuts(r, on_cut)
        r.add_listener(on_apply, on_install)
        self.mirror.attach(addr, seat.incarnation, r, rp.CLUSTER_ID)
        self.note(f"{addr} started (run {seat.incarnation})")

    def crash(self, addr: str, power: bool) -> None:
        self.note(rp.crash_note(self.seats[addr], self.net, power, self.rng))

    def leader(self) -> str | None:
        return rp.leader_of(self.seats)

    def _maybe_fault(self) -> None:
        faults.maybe_fault(self, self.members)

    # ------------------------------------------------------------ clients

    def _client(self, faults: bool) -> None:
        def alive(addr: str, incarnation: int) -> bool:
            s = self.seats[addr]
            return s.up and s.incarnation == incarnation

        self.work.expire(self.clock.now, alive)
        self.members.settle_late(self)  # may stop a replica: the running ones are known after
        running = {a: s for a, s in self.seats.items() if s.up}
        for started in self.work.retry(self.clock.now, running):
            self.note(started)
        if faults and self.rng.random() < self.knobs.op:
            bulk = self.rng.random() < self.knobs.bulk
            started = self.work.start_op(self.clock.now, running, bulk)
            if started:
                self.note(started)

    # ------------------------------------------------------------ checks

    def _check(self, final: bool = False) -> None:
        sample = final or self.step % DIGEST_EVERY_STEPS == 0
        for addr in sorted(self.seats):
            seat = self.seats[addr]
            if seat.replica is not None:
                check_seat(self.inv, addr, seat, sample, self.note)
                self.max_commit = max(self.max_commit, seat.checked_commit)
        self._check_mirror(sample)

    def _check_mirror(self, sample: bool) -> None:
        m = self.mirror.mirror
        self.mirror_checks.position(m.applied_index, m.commit_index, self.max_commit)
        # Only where a replica's digest at that index is known (the source's, when the
        # mirror has caught up with it): a digest of its own would be compared with none.
        comparable = m.applied_index in self.inv.digests
        if sample and m.ready and comparable and m.applied_index != self._mirror_seen:
            applied, digest = m.digest()
            self._mirror_seen = applied
            self.mirror_digests += 1
            self.inv.digest("mirror", applied, digest)

    # ------------------------------------------------------------ the end

    def _heal(self) -> None:
        self.net.heal()
        self.net.faults = NetFaults()
        self.note("heal: network whole and clean, every replica restarted")
        for _ in range(HEAL_STEPS_MAX):
            for addr in sorted(self.members.members | ending.configuration(self)):
                if not self.seats[addr].up:  # a change settled late may name one more
                    self.start(addr)
            self._step(faults=False)
            if ending.converged(self, self.members):
                break
        else:
            self.violation(
                "stuck", f"no convergence within {HEAL_STEPS_MAX} steps: {ending.positions(self)}"
            )
        self._mirror_catches_up()
        self._check(final=True)  # every replica's digest, at the index they all reached
        self.inv.never_committed()
        ending.check_history(self)
        self.result.stats = self._stats()
        self.note(f"end {self.result.stats}")

    def _mirror_catches_up(self) -> None:
        """The quiet, healed cluster: the mirror must reach the leader's applied index."""
        leader = self.leader()
        lr = None if leader is None else self.seats[leader].replica
        if lr is None:
            return
        target = int(lr.raftLastApplied)
        for _ in range(FINAL_PUMPS_MAX):
            if self.mirror.mirror.applied_index >= target:
                break
            self.mirror.step(self._running(), quiet=True)
        m = self.mirror.mirror
        if m.applied_index != target:
            self.violation(
                "mirror_stuck",
                f"mirror at {m.applied_index} (ready {m.ready}, source "
                f"{self.mirror.source()}), the healed leader applied {target}",
            )

    def _stats(self) -> dict[str, object]:
        ops = self.work.ops
        return {
            "ops": len(ops),
            "ok": sum(o.outcome == "ok" for o in ops),
            "unknown": sum(o.outcome == "unknown" for o in ops),
            "rejected": self.work.rejected,
            "bulk_publishes": self.work.bulk_publishes,
            "terms": len(self.inv.leaders),
            "committed": max(self.inv.committed, default=0),
            "messages": self.net.sent,
            "log_lines": dict(sorted(self.logged.items())),
            "mirror": {
                "applied": self.mirror.mirror.applied_index,
                "streams": self.mirror.streams,
                "snapshots": self.mirror.mirror.snapshots,
                "events": self.mirror.events,
                "digests": self.mirror_digests,
            },
            "steps_run": self.step,
        }


@contextlib.contextmanager
def logs_counted(logged: dict[str, int]) -> Iterator[None]:
    """While a run lasts, the replicas' warnings and errors are counted into `logged`,
    not printed (`LogCounter`)."""
    root_log = logging.getLogger()
    saved = (root_log.level, root_log.handlers)
    root_log.handlers = [LogCounter(logged)]
    root_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root_log.setLevel(saved[0])
        root_log.handlers = saved[1]


def tmp_root() -> str:
    return SHM if os.path.isdir(SHM) else tempfile.gettempdir()


def run_seed(seed: int, steps: int, replicas: int = 3, retries: bool = True) -> Result:
    return Simulation(seed, steps, replicas, retries=retries).run()


__all__ = ["Knobs", "Result", "Simulation", "run_seed"]
