"""One seeded run of several Raft groups: a split and a move under faults (issue 31).

G groups (`group.SimGroup`) of 3 real replicas each, on one simulated clock;
g0 holds the shard map in its log. Each step advances the clock one tick;
every group delivers its due messages and ticks its replicas; every group's
Raft invariants are checked (`checks.Invariants`, as for one group); each
group may then take one fault (`faults.maybe_fault`, with the group's own
seeded rates: crashes with and without power loss, blackouts, restarts,
partitions, leadership transfers, compactions; message loss, duplication,
reordering and delay are its network's); the non-home replicas refresh their
map views; the operator (`mover`) takes its next step: the initial map, one
split, one move; and the clients (`shard_clients`) start or retry operations.

After the last step the run heals every group (the network whole and clean,
every replica restarted) and goes on until the move has finished, every
client operation is answered and every group has converged (`ending`), or
`HEAL_STEPS_MAX` steps pass ("stuck"). Then (`shard_checks`): each key's
final record, read from the group that owns it under the final map, must
follow from its history, and the history (writes and linearizable lookups)
must be linearizable; no group may hold an entry of a key it does not own.

Everything is decided by the seed; the trace of a seed is the same on every
replay.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time

from bench.sim import ending, faults, shard_checks
from bench.sim import replicas as rp
from bench.sim.checks import Violation
from bench.sim.group import SimGroup
from bench.sim.knobs import Result
from bench.sim.mover import Mover, Plan, Sabotage
from bench.sim.net import NetFaults
from bench.sim.shard_clients import ShardClients, choose_keys
from bench.sim.simulation import DIGEST_EVERY_STEPS, TICK_S, logs_counted, tmp_root
from kvdir.core.shard_map import Group

HEAL_STEPS_MAX = 4000
"""After the faults: steps allowed for the move to finish and every group to converge."""
OP_RATE = 0.5
"""Per step: the chance the clients start an operation."""


class GroupsSimulation:
    """One seeded run over `groups` groups (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        steps: int,
        groups: int = 2,
        disk_lies: bool = False,
        sabotage: Sabotage | None = None,
        reads_ignore_map: bool = False,
        quiet: bool = False,
    ) -> None:
        """`disk_lies`, `sabotage`, `reads_ignore_map`: tests only, a run that must fail
        its checks; `quiet`: no faults at all (a run whose only events are the clients'
        and the mover's)."""
        if groups < 2:
            raise ValueError("a run of groups needs at least 2 groups")
        self.seed, self.steps, self.n = seed, steps, groups
        self.rng = random.Random(f"groups/{seed}")
        self.clock = rp.SimClock()
        self.step = 0
        self.result = Result(seed, steps, 3)
        self.result.stats["groups"] = groups
        self.trace = self.result.trace
        self.logged: dict[str, int] = {}
        self.quiet = quiet
        self._tmp = tempfile.mkdtemp(prefix="kvdir-sim-groups-", dir=tmp_root())
        self.groups = {
            f"g{i}": SimGroup(
                f"g{i}", i, seed, self._tmp, self.clock, self.note, self.violation, disk_lies
            )
            for i in range(groups)
        }
        plan_groups = tuple(Group(g.gid, tuple(g.addresses)) for g in self.groups.values())
        self.plan = Plan.draw(self.rng, plan_groups)
        self.mover = Mover(self.groups, self.plan, self.note, self.violation, sabotage)
        keys = choose_keys(self.plan.final(), self.rng)
        self.clients = ShardClients(
            self.groups,
            keys,
            random.Random(f"clients/{seed}"),
            self.note,
            self.violation,
            reads_ignore_map,
        )

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
        try:
            with logs_counted(self.logged), self.clock.installed(self.seed):
                self._run()
        finally:
            for g in self.groups.values():
                for seat in g.seats.values():
                    rp.close(seat)
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.result.seconds = time.process_time() - t0
        return self.result

    def _run(self) -> None:
        p = self.plan
        self.note(
            f"plan: split shard {p.split_shard} (new {p.new_shard}) {p.split_at} steps in, "
            f"move shard {p.move_shard} to {p.target} {p.move_at} steps later, "
            f"imports in batches of {p.batch}; keys {[k.name for k in self.clients.keys]}"
        )
        for g in self.groups.values():
            self.note(f"{g.gid} knobs {g.knobs}")
            for addr in g.addresses:
                g.start(addr)
        for _ in range(self.steps):
            self._step(faults=not self.quiet, ops=True)
        self._heal()

    def _step(self, faults: bool, ops: bool) -> None:
        self.step += 1
        self.clock.now += TICK_S
        for g in self.groups.values():
            g.step = self.step
            g.tick()
        for g in self.groups.values():
            g.check(False, DIGEST_EVERY_STEPS)
        if faults:
            for g in self.groups.values():
                _fault(g)
        fetch = self.clients.fetch
        for g in self.groups.values():
            g.refresh(fetch)
        self.mover.step()
        self.clients.step(self.clock.now, self.step)
        if ops and self.rng.random() < OP_RATE:
            started = self.clients.start_op(self.clock.now, self.step)
            if started:
                self.note(started)

    # ------------------------------------------------------------ the end

    def _heal(self) -> None:
        for g in self.groups.values():
            g.net.heal()
            g.net.faults = NetFaults()
        self.note("heal: every network whole and clean, every replica restarted")
        for _ in range(HEAL_STEPS_MAX):
            for g in self.groups.values():
                for addr in g.addresses:
                    if not g.seats[addr].up:
                        g.start(addr)
            self._step(faults=False, ops=False)
            if not self.mover.busy and not self.clients.busy and self._converged():
                break
        else:
            where = "; ".join(ending.positions(g) for g in self.groups.values())
            self.violation(
                "stuck",
                f"within {HEAL_STEPS_MAX} steps: move at {self.mover.stage!r}, "
                f"clients waiting {len(self.clients.busy)}, {where}"[:600],
            )
        for g in self.groups.values():
            g.check(True, DIGEST_EVERY_STEPS)
            g.inv.never_committed()
        shard_checks.check_end(self)
        self.result.stats.update(self._stats())
        self.note(f"end {self.result.stats}")

    def _converged(self) -> bool:
        return all(ending.converged(g, g.members) for g in self.groups.values())

    def _stats(self) -> dict[str, object]:
        ops = self.clients.ops
        return {
            "ops": len(ops),
            "ok": sum(o.outcome == "ok" for o in ops),
            "unknown": sum(o.outcome == "unknown" for o in ops),
            "failed": sum(o.outcome == "fail" for o in ops),
            "refusals": self.clients.refusals,
            "move": self.mover.stage,
            "imported": self.mover.imported,
            "dropped": self.mover.dropped,
            "watch_reopens": self.mover.reopens,
            "copy_clears": self.mover.clears,
            "terms": {g.gid: len(g.inv.leaders) for g in self.groups.values()},
            "committed": {g.gid: max(g.inv.committed, default=0) for g in self.groups.values()},
            "messages": sum(g.net.sent for g in self.groups.values()),
            "log_lines": dict(sorted(self.logged.items())),
            "steps_run": self.step,
        }


def _fault(g: SimGroup) -> None:
    faults.maybe_fault(g, g.members)


def run_groups(seed: int, steps: int, groups: int = 2) -> Result:
    return GroupsSimulation(seed, steps, groups).run()


__all__ = ["GroupsSimulation", "run_groups"]
