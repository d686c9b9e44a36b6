"""Membership changes in the simulator: remove a member, later add it back empty.

As an operator replaces a replica (`kvdir ctl remove-replica`, then a new one
joins): the leader proposes pysyncobj's removal of a follower; once the
leader reports it done, that replica is stopped and its data dir wiped. A
later change starts it again, empty and joining (`join=True`: it never
campaigns before it hears a leader), and the leader proposes adding it.
One change at a time (pysyncobj refuses a second while one is pending). A
change whose callback never comes (its leader crashed) is settled after
`CHANGE_WAIT_S` by what the current leader's configuration says.

Its own random stream (`members/<seed>`), so a seed whose rate is zero
runs exactly as it would without this module.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

from pysyncobj import FAIL_REASON
from pysyncobj.node import TCPNode

from bench.sim.cluster import Cluster
from bench.sim.disk import Disk

CHANGE_WAIT_S = 5.0
"""Simulated seconds before a change with no answer is settled from the leader's view."""


@dataclass
class _Change:
    kind: str
    address: str
    deadline: float


@dataclass
class Membership:
    rng: random.Random
    members: set[str]
    changing: _Change | None = None
    wipes: int = 0
    done: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, seed: int, addresses: list[str]) -> Membership:
        return cls(random.Random(f"members/{seed}"), set(addresses))

    def draw_rate(self) -> float:
        return self.rng.choice([0.0, 0.0, 0.002, 0.005])

    def maybe_change(self, sim: Cluster, rate: float) -> None:
        if self.changing is not None or self.rng.random() >= rate:
            return
        leader = sim.leader()
        if leader is None:
            return
        lr = sim.seats[leader].replica
        assert lr is not None
        removed = sorted(set(sim.seats) - self.members)
        if removed:
            addr = removed[0]
            self._wipe(sim, addr)
            sim.start(addr, peers=sorted(self.members | {addr}), join=True)
            self.changing = _Change("add", addr, sim.clock.now + CHANGE_WAIT_S)
            lr.addNodeToCluster(TCPNode(addr), callback=self._answer(sim, "add", addr))
            sim.note(f"{leader} proposes adding {addr} (empty, joining)")
            return
        others = sorted(a for a in self.members if a != leader)
        if len(others) < 2:
            return
        addr = self.rng.choice(others)
        self.changing = _Change("remove", addr, sim.clock.now + CHANGE_WAIT_S)
        lr.removeNodeFromCluster(addr, callback=self._answer(sim, "remove", addr))
        sim.note(f"{leader} proposes removing {addr}")

    def _answer(self, sim: Cluster, kind: str, addr: str) -> Any:
        def done(_result: Any, error: int) -> None:
            change = self.changing
            if change is None or (change.kind, change.address) != (kind, addr):
                return  # settled already
            self._settle(sim, change, error == FAIL_REASON.SUCCESS, f"error {error}")

        return done

    def settle_late(self, sim: Cluster) -> None:
        """A change with no answer by its deadline: the current leader's view decides."""
        change = self.changing
        if change is None or sim.clock.now < change.deadline:
            return
        leader = sim.leader()
        if leader is None:
            return
        lr = sim.seats[leader].replica
        assert lr is not None
        now_in = change.address == leader or any(n.address == change.address for n in lr.otherNodes)
        self._settle(sim, change, now_in == (change.kind == "add"), "no answer")

    def _settle(self, sim: Cluster, change: _Change, took: bool, why: str) -> None:
        self.changing = None
        addr = change.address
        if change.kind == "add":
            if took:
                self.members.add(addr)
            else:
                sim.crash(addr, False)  # not a member: it must not run
        elif took:
            self.members.discard(addr)
            sim.crash(addr, False)
        sim.note(f"{change.kind} {addr}: {'done' if took else 'not done (' + why + ')'}")

    def _wipe(self, sim: Cluster, addr: str) -> None:
        """A new, empty data dir for the seat (the replaced replica's disk is gone)."""
        seat = sim.seats[addr]
        self.wipes += 1
        seat.data_dir = f"{seat.data_dir.split('~')[0]}~{self.wipes}"
        os.makedirs(seat.data_dir, exist_ok=True)
        seat.disk = Disk(seat.data_dir, lies=sim.disk_lies)


__all__ = ["CHANGE_WAIT_S", "Membership"]
