"""One seeded run: N real replicas, a seeded network and disk, faults, clients, checks.

A step is one tick period of simulated time: the clock advances, due
messages reach each running replica (in a seeded order) followed by its Raft
tick, as pysyncobj's loop does (poll, then tick); queued background jobs (the
dump writer) whose step came run; every invariant (`checks`) is checked;
then the seed may inject one fault and start client operations.

Faults, each drawn with the seed's own rates (`Knobs`): crash of a replica
(with or without power loss, unsynced writes gone), a power cut of every
replica at once, restart, partition
(a random split or one replica cut off) and heal, leadership transfer,
forced log compaction (and compaction on small thresholds throughout, so
snapshot installs to lagging followers happen), message loss, delay,
duplication and reordering (`net.NetFaults`), membership changes (a
follower removed, later added back empty: `membership`).

After the last step the run heals: the network is made whole and clean,
every replica restarts, and the run goes on until all replicas applied the
leader's commit index (or `HEAL_STEPS_MAX` steps pass: "stuck"). Then the
history is checked for linearizability (`bench.chaos.checker.check_key`)
and, with the healed table's records as a final read of every key, for
acknowledged writes missing from it (`_final_read`).

Everything is decided by the seed; the trace (`Result.trace`) of a seed is
identical on every replay.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.checker import by_key, check_key
from bench.chaos.history import Op
from bench.sim import replicas as rp
from bench.sim.checks import Invariants, Violation, watch_cuts
from bench.sim.disk import Disk
from bench.sim.membership import Membership
from bench.sim.net import NetFaults, Network
from bench.sim.workload import Workload
from kvdir.directory.consensus.tuning import RaftTuning

TICK_S = 0.01
HEAL_STEPS_MAX = 3000
"""After the faults: steps (of TICK_S) allowed for every replica to catch up."""
TRACE_LINES_MAX = 60
"""Lines of trace kept for a failure report (the newest)."""
DIGEST_EVERY_STEPS = 50
"""Table digests are compared every this many steps (a digest reads the whole table)."""
SHM = "/dev/shm"


@dataclass(frozen=True, slots=True)
class Knobs:
    """Every rate of one run, drawn from its seed."""

    net: NetFaults
    crash: float
    power_loss: float
    blackout: float
    """A power cut of every replica at once."""
    restart: float
    partition: float
    heal: float
    transfer: float
    compact: float
    op: float
    bulk: float
    dump_delay_steps_max: int
    compaction_min_entries: int
    compaction_min_time_s: float
    membership: float = 0.0
    """Per step: the chance of starting a membership change (`membership`)."""

    @classmethod
    def draw(cls, rng: random.Random) -> Knobs:
        net = NetFaults(
            loss=rng.choice([0.0, 0.01, 0.05, 0.2]),
            duplicate=rng.choice([0.0, 0.0, 0.02, 0.1]),
            reorder=rng.choice([0.0, 0.0, 0.05, 0.3]),
            delay_min_s=0.0005,
            delay_max_s=rng.choice([0.002, 0.01, 0.05, 0.2]),
        )
        return cls(
            net=net,
            crash=rng.choice([0.0, 0.001, 0.003, 0.01]),
            power_loss=rng.choice([0.0, 0.5, 1.0]),
            blackout=rng.choice([0.0, 0.0, 0.001, 0.003]),
            restart=rng.choice([0.02, 0.05, 0.2]),
            partition=rng.choice([0.0, 0.002, 0.01]),
            heal=rng.choice([0.01, 0.05]),
            transfer=rng.choice([0.0, 0.002, 0.01]),
            compact=rng.choice([0.0, 0.005, 0.02]),
            op=rng.choice([0.2, 0.5, 1.0]),
            bulk=rng.choice([0.0, 0.0, 0.003, 0.01]),
            dump_delay_steps_max=rng.choice([0, 5, 50]),
            compaction_min_entries=rng.choice([10, 30, 100, 20_000]),
            compaction_min_time_s=rng.choice([2.0, 6.0, 600.0]),
        )


@dataclass
class Result:
    seed: int
    steps: int
    replicas: int
    violations: list[Violation] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    """Every event of the run, in order (the full record; `tail` is what is printed)."""
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def tail(self, lines: int = TRACE_LINES_MAX) -> list[str]:
        return self.trace[-lines:]

    def summary(self) -> str:
        kinds = sorted({v.kind for v in self.violations})
        head = f"seed {self.seed} ({self.replicas} replicas, {self.steps} steps)"
        if self.ok:
            return f"{head}: ok"
        return f"{head}: FAILED {', '.join(kinds)}\n  " + "\n  ".join(
            [str(v) for v in self.violations[:10]] + ["trace (last lines):"] + self.tail()
        )


class _LogCounter(logging.Handler):
    """Counts warnings and errors the replicas log (pysyncobj's 'failed' lines among them)."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(logging.WARNING)
        self.sim = sim

    def emit(self, record: logging.LogRecord) -> None:
        self.sim.logged[record.name] = self.sim.logged.get(record.name, 0) + 1


class Simulation:
    def __init__(
        self,
        seed: int,
        steps: int,
        replicas: int = 3,
        knobs: Knobs | None = None,
        disk_lies: bool = False,
    ) -> None:
        """`knobs`: fixed rates instead of the seed's; `disk_lies`: syncs record nothing
        (a disk that loses everything at a power cut: the checks must then catch lost
        writes, which is how the tests know they can fail)."""
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
        self.inv = Invariants(self._violation)
        self.logged: dict[str, int] = {}
        self.tuning = RaftTuning(
            compaction_min_entries=self.knobs.compaction_min_entries,
            compaction_min_time_s=self.knobs.compaction_min_time_s,
        )
        self._tmp = ""
        self.seats: dict[str, rp.SimReplica] = {}
        self.work = Workload(owners=3, keys_per_owner=4, rng=random.Random(f"ops/{seed}"))
        self._job_order = 0

    # ------------------------------------------------------------------ trace

    def _note(self, text: str) -> None:
        self.trace.append(f"{self.step:5d} {text}")

    def _violation(self, kind: str, detail: str) -> None:
        v = Violation(kind, self.step, detail)
        self.result.violations.append(v)
        self._note(f"VIOLATION {v.kind}: {detail}")

    # ------------------------------------------------------------------ run

    def run(self) -> Result:
        t0 = time.perf_counter()
        self._tmp = tempfile.mkdtemp(prefix="kvdir-sim-", dir=_tmp_root())
        root_log = logging.getLogger()
        saved = (root_log.level, root_log.handlers)
        root_log.handlers = [_LogCounter(self)]  # count, do not print, the replicas' lines
        root_log.setLevel(logging.WARNING)
        try:
            with self.clock.installed(self.seed):
                self._run()
        finally:
            root_log.setLevel(saved[0])
            root_log.handlers = saved[1]
            for seat in self.seats.values():
                _close(seat)
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.result.seconds = time.perf_counter() - t0
        return self.result

    def _run(self) -> None:
        self._note(f"knobs {self.knobs}")
        for addr in self.addresses:
            d = f"{self._tmp}/{addr.rsplit(':', 1)[1]}"
            self.seats[addr] = rp.SimReplica(addr, d, Disk(_mkdir(d), lies=self.disk_lies))
            self._start(addr)
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
        self._check()  # before any fault: a replica that crashes now was seen as it was
        if faults:
            self._maybe_fault()
        self._client(faults)

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
        self._violation("tick_error", f"{seat.address} {where}: {type(e).__name__}: {e}"[:300])

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
        self._note(f"{seat.address} dump writer queued for step {due}")

    # ------------------------------------------------------------ replicas

    def _start(self, addr: str, peers: list[str] | None = None, join: bool = False) -> None:
        seat = self.seats[addr]
        peers = peers or sorted(self.members.members)
        try:
            r = rp.start(seat, peers, self.tuning, self.net, self._background, join)
        except Exception as e:
            self._violation("start_failed", f"{addr}: {type(e).__name__}: {e}"[:300])
            return

        def on_cut(index: int) -> None:
            self._note(
                f"{addr} cuts its log from {index} (last {r.last_log_index()}, "
                f"commit {int(r.raftCommitIndex)})"
            )
            self.inv.cut(addr, r, index)

        def on_install(index: int) -> None:
            self._note(f"{addr} loaded a snapshot up to {index}")

        def on_apply(index: int, _cmd: object, _res: object) -> None:
            self.inv.applied(addr, index, r.entry_at(index))

        watch_cuts(r, on_cut)
        r.add_listener(on_apply, on_install)
        self._note(f"{addr} started (run {seat.incarnation})")

    def _crash(self, addr: str, power: bool) -> None:
        lost = rp.crash(self.seats[addr], self.net, power, self.rng)
        what = f"power loss (lost {', '.join(lost) or 'no file'})" if power else "crash"
        self._note(f"{addr} {what}")

    # ------------------------------------------------------------ faults

    def _maybe_fault(self) -> None:
        k, rng = self.knobs, self.rng
        up = [a for a in sorted(self.seats) if self.seats[a].up]
        down = [a for a in sorted(self.seats) if not self.seats[a].up and a in self.members.members]
        roll = rng.random()
        if up and roll < k.blackout:
            self._note("blackout: every replica loses power")
            for addr in up:
                self._crash(addr, True)
        elif up and roll < k.blackout + k.crash:
            self._crash(rng.choice(up), rng.random() < k.power_loss)
        elif down and rng.random() < k.restart:
            self._start(rng.choice(down))
        elif not self.net.cut and rng.random() < k.partition:
            self._partition()
        elif self.net.cut and rng.random() < k.heal:
            self.net.heal()
            self._note("partition healed")
        elif rng.random() < k.transfer:
            leader = self._leader()
            if leader is not None:
                self.seats[leader].replica.transferLeadership()  # type: ignore[union-attr]
                self._note(f"{leader} asked to transfer leadership")
        elif up and rng.random() < k.compact:
            addr = rng.choice(up)
            self.seats[addr].replica.forceLogCompaction()  # type: ignore[union-attr]
            self._note(f"{addr} forced compaction")
        else:
            self.members.maybe_change(self, k.membership)

    def _partition(self) -> None:
        addrs = sorted(self.seats)
        self.rng.shuffle(addrs)
        if self.rng.random() < 0.5:
            groups = [addrs[:1], addrs[1:]]
        else:
            cut = self.rng.randint(1, len(addrs) - 1)
            groups = [addrs[:cut], addrs[cut:]]
        self.net.partition(groups)
        self._note(f"partition {groups}")

    def _leader(self) -> str | None:
        best: tuple[int, str] | None = None
        for addr, seat in sorted(self.seats.items()):
            r = seat.replica
            if r is not None and r.role() == 2:
                cand = (int(r.raftCurrentTerm), addr)
                best = cand if best is None or cand > best else best
        return None if best is None else best[1]

    # ------------------------------------------------------------ clients

    def _client(self, faults: bool) -> None:
        def alive(addr: str, incarnation: int) -> bool:
            s = self.seats[addr]
            return s.up and s.incarnation == incarnation

        self.work.expire(self.clock.now, alive)
        self.members.settle_late(self)  # may stop a replica: the running ones are known after
        running = {a: s for a, s in self.seats.items() if s.up}
        if faults and self.rng.random() < self.knobs.op:
            bulk = self.rng.random() < self.knobs.bulk
            started = self.work.start_op(self.clock.now, running, bulk)
            if started:
                self._note(started)

    # ------------------------------------------------------------ checks

    def _check(self, final: bool = False) -> None:
        sample = self.step % DIGEST_EVERY_STEPS == 0
        for addr in sorted(self.seats):
            seat = self.seats[addr]
            r = seat.replica
            if r is None:
                continue
            role, term = r.role(), int(r.raftCurrentTerm)
            self.inv.leader(addr, role, term)
            if (role, term) != seat.seen_role:
                seat.seen_role = (role, term)
                name = ("follower", "candidate", "leader")[role]
                self._note(f"{addr} {name} in term {term} (commit {int(r.raftCommitIndex)})")
            seat.checked_commit = self.inv.commit(addr, r, seat.checked_commit)
            applied = int(r.raftLastApplied)
            if (sample or final) and applied != seat.seen_applied:
                seat.seen_applied = applied
                self.inv.digest(addr, applied, r.table.digest())

    # ------------------------------------------------------------ the end

    def _heal(self) -> None:
        self.net.heal()
        self.net.faults = NetFaults()
        self._note("heal: network whole and clean, every replica restarted")
        for _ in range(HEAL_STEPS_MAX):
            for addr in sorted(self.members.members | self._configuration()):
                if not self.seats[addr].up:  # a change settled late may name one more
                    self._start(addr)
            self._step(faults=False)
            if self._converged():
                break
        else:
            self._violation(
                "stuck", f"no convergence within {HEAL_STEPS_MAX} steps: {self._positions()}"
            )
        self._final_checks()

    def _final_read(self, key: str, value: int | None, ops: list[Op]) -> None:
        """The healed table's record, as one more linearizable read after everything:
        if no order of the history ends there, an acknowledged write is missing (or a
        write appeared from nowhere). A plain "is every acknowledged generation still
        there" check is wrong here: an unknown publish of an older generation may apply
        after a newer one was removed (seed 477) and is then the final record."""
        end = float(self.work.tick())
        read = Op(key, "read", key, end, end, "ok", value=value, mode="lin")
        history = [o for o in ops if o.key == key and o.outcome != "fail"]
        if check_key([*history, read]) != "ok":
            acked = [o.value for o in history if o.kind == "publish" and o.outcome == "ok"]
            self._violation(
                "lost_write",
                f"key {key}: final g{value} follows from no order of its history "
                f"(acknowledged publishes {acked[-3:]})",
            )

    def _positions(self) -> str:
        """Each replica's (role, term, commit, applied, last index), for a stuck run."""
        out = []
        for addr, seat in sorted(self.seats.items()):
            r = seat.replica
            if r is None:
                out.append(f"{addr} down")
                continue
            out.append(
                f"{addr} role {r.role()} term {int(r.raftCurrentTerm)} commit "
                f"{int(r.raftCommitIndex)} applied {int(r.raftLastApplied)} last "
                f"{r.last_log_index()}"
            )
        return "; ".join(out) + f"; clients waiting {len(self.work.busy)}"

    def _configuration(self) -> set[str]:
        """The members as the leader has them (empty without a leader)."""
        leader = self._leader()
        if leader is None:
            return set()
        lr = self.seats[leader].replica
        assert lr is not None
        return {leader} | {str(n.address) for n in lr.otherNodes}

    def _converged(self) -> bool:
        """Every member of the leader's configuration applied the leader's whole log.

        The leader's configuration, not the simulator's: a membership change whose
        leader crashed before answering may still take effect later (its entry
        survives in the next leader's log) after the simulator settled it as not done.
        """
        leader = self._leader()
        if leader is None or self.work.busy or self.members.changing is not None:
            return False
        lr = self.seats[leader].replica
        assert lr is not None
        target = int(lr.raftCommitIndex)
        if target < lr.last_log_index():
            return False
        return all(
            (r := self.seats[a].replica) is not None and int(r.raftLastApplied) == target
            for a in self._configuration()
        )

    def _final_checks(self) -> None:
        self._check(final=True)  # every replica's digest, at the index they all reached
        self.inv.never_committed()
        ops = self.work.ops
        for key, verdict in sorted(
            (k, check_key(v)) for k, v in by_key(o for o in ops if o.outcome != "fail").items()
        ):
            if verdict != "ok":
                self._violation("not_linearizable", f"key {key}: {verdict}")
        leader = self._leader()
        if leader is not None:
            lr = self.seats[leader].replica
            assert lr is not None
            final = self.work.final_state(lr.table)
            for key, value in sorted(final.items(), key=lambda kv: kv[0]):
                self._final_read(key, value, ops)
        self.result.stats = {
            "ops": len(ops),
            "ok": sum(o.outcome == "ok" for o in ops),
            "unknown": sum(o.outcome == "unknown" for o in ops),
            "rejected": self.work.rejected,
            "bulk_publishes": self.work.bulk_publishes,
            "terms": len(self.inv.leaders),
            "committed": max(self.inv.committed, default=0),
            "messages": self.net.sent,
            "log_lines": dict(sorted(self.logged.items())),
            "steps_run": self.step,
        }
        self._note(f"end {self.result.stats}")


def _mkdir(path: str) -> str:
    import os

    os.makedirs(path, exist_ok=True)
    return path


def _tmp_root() -> str:
    import os

    return SHM if os.path.isdir(SHM) else tempfile.gettempdir()


def _close(seat: rp.SimReplica) -> None:
    try:
        rp.stop_clean(seat)
    except Exception:  # a replica broken by the run must not hide the run's result
        seat.replica = None


def run_seed(seed: int, steps: int, replicas: int = 3) -> Result:
    return Simulation(seed, steps, replicas).run()


__all__ = ["Knobs", "Result", "Simulation", "run_seed"]
