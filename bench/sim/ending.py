"""The end of a run: when the healed cluster has converged, and the checks of its history.

After the last step the run heals (the network whole and clean, every
member restarted) and steps until every member of the leader's
configuration applied the leader's whole log (`converged`). Then the
history is checked for linearizability (`bench.chaos.checker.check_key`)
and, with the healed table's records as a final read of every key, for
acknowledged writes missing from it (`final_read`).
"""

from __future__ import annotations

from bench.chaos.checker import by_key, check_key
from bench.chaos.history import Op
from bench.sim.cluster import Cluster
from bench.sim.membership import Membership


def configuration(sim: Cluster) -> set[str]:
    """The members as the leader has them (empty without a leader)."""
    leader = sim.leader()
    if leader is None:
        return set()
    lr = sim.seats[leader].replica
    assert lr is not None
    return {leader} | {str(n.address) for n in lr.otherNodes}


def converged(sim: Cluster, members: Membership) -> bool:
    """Every member of the leader's configuration applied the leader's whole log.

    The leader's configuration, not the simulator's: a membership change whose
    leader crashed before answering may still take effect later (its entry
    survives in the next leader's log) after the simulator settled it as not done.
    """
    leader = sim.leader()
    if leader is None or sim.work.busy or members.changing is not None:
        return False
    lr = sim.seats[leader].replica
    assert lr is not None
    target = int(lr.raftCommitIndex)
    if target < lr.last_log_index():
        return False
    return all(
        (r := sim.seats[a].replica) is not None and int(r.raftLastApplied) == target
        for a in configuration(sim)
    )


def positions(sim: Cluster) -> str:
    """Each replica's (role, term, commit, applied, last index), for a stuck run."""
    out = []
    for addr, seat in sorted(sim.seats.items()):
        r = seat.replica
        if r is None:
            out.append(f"{addr} down")
            continue
        out.append(
            f"{addr} role {r.role()} term {int(r.raftCurrentTerm)} commit "
            f"{int(r.raftCommitIndex)} applied {int(r.raftLastApplied)} last "
            f"{r.last_log_index()}"
        )
    return "; ".join(out) + f"; clients waiting {len(sim.work.busy)}"


def check_history(sim: Cluster) -> None:
    """Linearizability of every key, then the healed table as a final read of each."""
    ops = sim.work.ops
    for key, verdict in sorted(
        (k, check_key(v)) for k, v in by_key(o for o in ops if o.outcome != "fail").items()
    ):
        if verdict != "ok":
            sim.violation("not_linearizable", f"key {key}: {verdict}")
    leader = sim.leader()
    if leader is not None:
        lr = sim.seats[leader].replica
        assert lr is not None
        final = sim.work.final_state(lr.table)
        for key, value in sorted(final.items(), key=lambda kv: kv[0]):
            final_read(sim, key, value, ops)


def final_read(sim: Cluster, key: str, value: int | None, ops: list[Op]) -> None:
    """The healed table's record, as one more linearizable read after everything:
    if no order of the history ends there, an acknowledged write is missing (or a
    write appeared from nowhere). A plain "is every acknowledged generation still
    there" check is wrong here: an unknown publish of an older generation may apply
    after a newer one was removed (seed 477) and is then the final record."""
    end = float(sim.work.tick())
    read = Op(key, "read", key, end, end, "ok", value=value, mode="lin")
    history = [o for o in ops if o.key == key and o.outcome != "fail"]
    if check_key([*history, read]) != "ok":
        acked = [o.value for o in history if o.kind == "publish" and o.outcome == "ok"]
        sim.violation(
            "lost_write",
            f"key {key}: final g{value} follows from no order of its history "
            f"(acknowledged publishes {acked[-3:]})",
        )


__all__ = ["check_history", "configuration", "converged", "final_read", "positions"]
