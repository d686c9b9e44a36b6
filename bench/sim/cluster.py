"""What the simulator's parts (faults, membership, the end of a run) see of a run.

`simulation.Simulation` is the one implementation; the parts depend on this
protocol, not on it, so imports flow one way (simulation -> the parts).
"""

from __future__ import annotations

import random
from typing import Protocol

from bench.sim import replicas as rp
from bench.sim.checks import Invariants
from bench.sim.knobs import Knobs
from bench.sim.net import Network
from bench.sim.workload import Workload


class Cluster(Protocol):
    seats: dict[str, rp.SimReplica]
    clock: rp.SimClock
    net: Network
    rng: random.Random
    knobs: Knobs
    work: Workload
    inv: Invariants
    disk_lies: bool
    step: int

    def note(self, text: str) -> None: ...

    def violation(self, kind: str, detail: str) -> None: ...

    def leader(self) -> str | None:
        """The running leader of the highest term (None: no leader)."""
        ...

    def start(self, addr: str, peers: list[str] | None = None, join: bool = False) -> None: ...

    def crash(self, addr: str, power: bool) -> None: ...


__all__ = ["Cluster"]
