"""What the replicas' JSON logs say: elections, compactions, CRITICAL and ERROR lines.

The replicas log one JSON object per line; these readers skip anything else
(a traceback, a half-written last line) rather than fail the report.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from bench.directory.cluster import Bench

ROLE_LEADER = 2
"""The `to` of a 'raft role changed' line when a replica became leader."""
RESTART_ELECTION_S = 60.0
"""An election this soon after a restart is blamed on the rejoining replica."""
KILL_ELECTION_S = 5.0
"""An election this soon after a SIGKILL is blamed on the kill."""


def read_log(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    except OSError:
        pass
    return out


def log_time(rec: dict[str, Any]) -> float:
    ts = str(rec.get("ts", "")).rstrip("Z")
    try:
        return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return math.nan


def became_leader(rec: dict[str, Any]) -> bool:
    return rec.get("msg") == "raft role changed" and rec.get("to") == ROLE_LEADER


def elections(b: Bench, since_wall: float = -math.inf) -> list[tuple[float, str]]:
    """(wall time, replica) of every 'became leader' line at or after `since_wall`."""
    out = []
    for r in b.cluster.replicas:
        for rec in read_log(r.log_path):
            if became_leader(rec):
                t = log_time(rec)
                if t >= since_wall - 0.002:
                    out.append((t, r.replica_id))
    return sorted(out)


def compaction_logs(b: Bench) -> dict[str, list[dict[str, Any]]]:
    return {
        r.replica_id: [x for x in read_log(r.log_path) if x.get("msg") == "compaction done"]
        for r in b.cluster.replicas
    }


def role_changes(b: Bench) -> list[tuple[float, str, Any]]:
    """(wall time, replica, new role) of every 'raft role changed' line."""
    return [
        (log_time(x), r.replica_id, x.get("to"))
        for r in b.cluster.replicas
        for x in read_log(r.log_path)
        if x.get("msg") == "raft role changed"
    ]


def _phase_at(b: Bench, t: float, first: bool) -> str:
    return next(
        (
            p["phase"]
            for p in b.phases
            if p["start_wall"] - 0.01 <= t <= p.get("end_wall", math.inf)
        ),
        "start-up" if first else "between phases",
    )


def _cause(b: Bench, t: float, first: bool) -> str:
    cause = "cluster start" if first else "unexplained (no kill or restart just before)"
    for rt, rrid in b.restart_walls:
        if rt <= t <= rt + RESTART_ELECTION_S:
            cause = f"after restarting {rrid} (the rejoining replica's election)"
    for kt, krid in b.kill_walls:
        if kt <= t <= kt + KILL_ELECTION_S:
            cause = f"SIGKILL of leader {krid}"
    return cause


def classify_elections(b: Bench) -> dict[str, Any]:
    """Every leader election in the replica logs, with its phase and likely cause."""
    out: list[dict[str, Any]] = [
        {
            "utc": dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S.%f")[:-3],
            "wall": t,
            "new_leader": rid,
            "phase": _phase_at(b, t, i == 0),
            "cause": _cause(b, t, i == 0),
        }
        for i, (t, rid) in enumerate(elections(b))
    ]
    return {
        "events": out,
        "total": len(out),
        "after_kill": sum(e["cause"].startswith("SIGKILL") for e in out),
        "after_restart": sum(e["cause"].startswith("after restarting") for e in out),
        "unexplained": sum(e["cause"].startswith("unexplained") for e in out),
    }


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    crit = [x for x in recs if x.get("level") == "critical"]
    return {
        "role_changes": sum(x.get("msg") == "raft role changed" for x in recs),
        "became_leader": sum(became_leader(x) for x in recs),
        "compactions": sum(x.get("msg") == "compaction done" for x in recs),
        "critical": len(crit),
        "truncating_applied": sum("truncating already-applied" in str(x.get("msg")) for x in crit),
        "errors": sum(x.get("level") == "error" for x in recs),
        "critical_samples": [f"{x.get('ts')} {x.get('msg')}" for x in crit[:2]],
    }


def log_summary(b: Bench) -> dict[str, Any]:
    return {r.replica_id: _summary(read_log(r.log_path)) for r in b.cluster.replicas}
