"""Phase: leader SIGKILLs under a continuous writer, and the write gap each one leaves.

Before each kill the writer has been writing steadily; after it, the gap is
from the last acknowledged write before the signal to the first after it.
The election time comes from the new leader's log line. The killed replica
is restarted and must catch up and rejoin the full Raft mesh before the next
kill, so every kill starts from a healthy 3-replica cluster.
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from typing import Any

from bench.directory import logs
from bench.directory.cluster import Bench
from bench.directory.threads import Writer, retire_writer, start_writer, wait_acks
from bench.measure import say
from kvdir.report import fmt

KILL_EARLY_ACK_S = 0.05
"""Acks this soon after a SIGKILL can only be the dead leader's last replies (a new
leader needs at least one 150 ms election timeout), so they count as before the kill."""
STEADY_S = 1.0
"""Steady writing before each kill."""
WRITER_S_PER_KILL = 180
AFTER_KILL_ACK_S = 20.0


def _kill(b: Bench, w: Writer) -> dict[str, Any]:
    """One SIGKILL of the leader: the gap, the election, the restart; raises on no progress."""
    leader = b.leader()
    terms0 = {rid: s.term for rid, s in b.statuses().items()}
    time.sleep(STEADY_S)  # let the writer run steadily; not a wait for a condition
    if not wait_acks(w, time.monotonic() - 0.2, 1, 10.0):
        raise RuntimeError("the writer stalled before a kill")
    wall, t_kill = time.time(), time.monotonic()
    b.cluster.kill(leader, signal.SIGKILL)
    b.kill_walls.append((wall, leader.replica_id))
    say(f"kill {len(b.kill_walls)}/{b.cfg.kills}: SIGKILL leader {leader.replica_id}")
    cut = t_kill + KILL_EARLY_ACK_S
    ok = wait_acks(w, cut, 1, AFTER_KILL_ACK_S)
    acks = list(w.acks)
    before = [t for _, t, _ in acks if t <= cut]
    after = [(s, t) for s, t, _ in acks if t > cut]
    rec: dict[str, Any] = {"killed": leader.replica_id, "term_before": terms0}
    if not ok or not before or not after:
        rec["error"] = "no acknowledged write after the kill within 20 s"
        return rec
    last_before, (first_sent, first_after) = before[-1], after[0]
    el = [e for e in logs.elections(b, wall) if e[1] != leader.replica_id]
    rec.update(
        {
            "gap_s": first_after - last_before,
            "kill_to_first_ack_s": first_after - t_kill,
            "last_ack_before_kill_s": t_kill - last_before,
            "first_ack_write_sent_s": first_sent - t_kill,
            "election_s": (el[0][0] - wall) if el else None,
            "new_leader": b.leader(20.0).replica_id,
            "term_after": {rid: s.term for rid, s in b.statuses().items()},
        }
    )
    _restart(b, leader.replica_id, rec)
    return rec


def _restart(b: Bench, rid: str, rec: dict[str, Any]) -> None:
    """Restart the killed replica and let it catch up before the next kill."""
    replica = next(r for r in b.cluster.replicas if r.replica_id == rid)
    t_restart = time.monotonic()
    b.restart_walls.append((time.time(), rid))
    b.cluster.launch(replica)
    rec["restart_caught_up_s"] = b.wait_caught_up(180.0, [replica])
    rec["restart_mesh_connected_s"] = time.monotonic() - t_restart + b.wait_connected(60.0)
    rec["restart_total_s"] = time.monotonic() - t_restart
    say(
        f"  gap {rec['gap_s'] * 1e3:.0f} ms (election "
        f"{fmt(rec['election_s'] and rec['election_s'] * 1e3)} ms), new leader "
        f"{rec['new_leader']}; {rid} back and caught up in {rec['restart_total_s']:.1f}s"
    )


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summary(kills: list[dict[str, Any]], acked: int, errors: list[str]) -> dict[str, Any]:
    gaps = [k["gap_s"] for k in kills if "gap_s" in k]
    elections = [k["election_s"] for k in kills if k.get("election_s") is not None]
    return {
        "kills": kills,
        "gaps_s": gaps,
        "gap_min_s": min(gaps) if gaps else math.nan,
        "gap_median_s": _median(gaps),
        "gap_max_s": max(gaps) if gaps else math.nan,
        "election_median_s": _median(elections),
        "writer": {
            "client": "directory.client.DirectoryClient (product retry policy), one "
            "writer thread, Publish of 16 fresh blocks per call, all 3 replicas known",
            "acked_writes": acked,
            "client_errors": len(errors),
            "client_error_samples": errors[:5],
        },
        "gap_definition": "last acknowledged write before the SIGKILL to the first "
        f"acknowledged write after it; acks within {KILL_EARLY_ACK_S * 1e3:.0f} ms of the "
        "signal were sent by the dying leader and count as before",
    }


def run(b: Bench) -> None:
    kills: list[dict[str, Any]] = []
    w = start_writer(b, max_s=b.cfg.kills * WRITER_S_PER_KILL + 60)
    try:
        if not wait_acks(w, time.monotonic(), 50, 30.0):
            raise RuntimeError("the writer made no progress before the first kill")
        for _ in range(b.cfg.kills):
            kills.append(_kill(b, w))
            if "error" in kills[-1]:
                raise RuntimeError(kills[-1]["error"])
    finally:
        acked_during, errors = len(w.acks), list(w.errors)
        retire_writer(b, w)
    b.results["failover"] = summary(kills, acked_during, errors)
