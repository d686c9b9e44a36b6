"""The faults a seed injects, at most one a step, each drawn with its own rate (`Knobs`).

A crash of a replica (with or without power loss: unsynced writes gone), a
power cut of every replica at once, a restart, a partition (a random split
or one replica cut off) and its heal, a leadership transfer, a forced log
compaction, and membership changes (`membership`). Message faults are the
network's (`net.NetFaults`), drawn per message.
"""

from __future__ import annotations

from bench.sim.cluster import Cluster
from bench.sim.membership import Membership


def maybe_fault(sim: Cluster, members: Membership) -> None:
    """One roll of the seed's dice (the order of the draws is part of every seed)."""
    k, rng = sim.knobs, sim.rng
    up = [a for a in sorted(sim.seats) if sim.seats[a].up]
    down = [a for a in sorted(sim.seats) if not sim.seats[a].up and a in members.members]
    roll = rng.random()
    if up and roll < k.blackout:
        sim.note("blackout: every replica loses power")
        for addr in up:
            sim.crash(addr, True)
    elif up and roll < k.blackout + k.crash:
        sim.crash(rng.choice(up), rng.random() < k.power_loss)
    elif down and rng.random() < k.restart:
        sim.start(rng.choice(down))
    elif not sim.net.cut and rng.random() < k.partition:
        partition(sim)
    elif sim.net.cut and rng.random() < k.heal:
        sim.net.heal()
        sim.note("partition healed")
    elif rng.random() < k.transfer:
        leader = sim.leader()
        if leader is not None:
            sim.seats[leader].replica.transferLeadership()  # type: ignore[union-attr]
            sim.note(f"{leader} asked to transfer leadership")
    elif up and rng.random() < k.compact:
        addr = rng.choice(up)
        sim.seats[addr].replica.forceLogCompaction()  # type: ignore[union-attr]
        sim.note(f"{addr} forced compaction")
    else:
        members.maybe_change(sim, k.membership)


def partition(sim: Cluster) -> None:
    addrs = sorted(sim.seats)
    sim.rng.shuffle(addrs)
    if sim.rng.random() < 0.5:
        groups = [addrs[:1], addrs[1:]]
    else:
        cut = sim.rng.randint(1, len(addrs) - 1)
        groups = [addrs[:cut], addrs[cut:]]
    sim.net.partition(groups)
    sim.note(f"partition {groups}")


__all__ = ["maybe_fault", "partition"]
