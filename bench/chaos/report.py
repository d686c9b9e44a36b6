"""The figures of a chaos run, as Markdown and JSON (machine, command, date included)."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdir import report as bench_report

if TYPE_CHECKING:
    from bench.chaos.checker import Report
    from bench.chaos.run import ChaosConfig

KILL_WRITE_MEDIAN_S = 0.5
KILL_WRITE_MAX_S = 2.0
FAULTS_LONG_RUN = 200


def targets(f: dict[str, Any]) -> list[bench_report.Target]:
    kill = f["unavailability"].get("kill-leader", {})
    w = kill.get("write_unavailable_s", {})
    gap = kill.get("follower_local_read_gap_s", {})
    return [
        bench_report.at_most("lost", "acknowledged publishes lost", f["lost"], 0, ""),
        bench_report.at_most(
            "linearizability", "linearizability violations", f["linearizability_violations"], 0, ""
        ),
        bench_report.at_most(
            "undecided", "keys the search could not decide", f["undecided_keys"], 0, ""
        ),
        bench_report.at_most(
            "wrong_records", "reads given a wrong record", f["wrong_records"], 0, ""
        ),
        bench_report.at_most(
            "backwards", "local reads that went backwards", f["local_backwards"], 0, ""
        ),
        bench_report.at_most(
            "lease_late", "crashed agents outliving lease + election", f["lease_late"], 0, ""
        ),
        bench_report.at_most(
            "stale_leader", "stale leader served", f["stale_leader_served"], 0, ""
        ),
        bench_report.at_least(
            "converged", "replicas converged (same digest)", int(f["converged"]), 1, ""
        ),
        bench_report.at_least(
            "faults", "faults injected (long run)", f["faults"], FAULTS_LONG_RUN, ""
        ),
        bench_report.at_most(
            "kill_write_median",
            "write unavailability after a leader kill, median",
            w.get("median"),
            KILL_WRITE_MEDIAN_S,
            "s",
        ),
        bench_report.at_most(
            "kill_write_max",
            "write unavailability after a leader kill, max",
            w.get("max"),
            KILL_WRITE_MAX_S,
            "s",
        ),
        bench_report.Target(
            "kill_follower_read_gap",
            "longest gap in follower local reads around a leader kill",
            "info (uninterrupted: ~ the reader's own pace)",
            gap.get("max"),
            "s",
            None,
        ),
    ]


def markdown(data: dict[str, Any]) -> str:
    f = data["figures"]
    out = [
        f"# Chaos run: {data['config']['replicas']} replicas, {f['faults']} faults",
        "",
        bench_report.header_markdown(data["header"]),
        "",
        "## Targets",
        "",
        bench_report.targets_table([bench_report.Target(**_t(t)) for t in data["targets"]]),
        "",
        "## Operations",
        "",
        bench_report.table(
            [
                ("operations recorded", f["operations"]),
                ("writes (publish/remove)", f["writes"]),
                ("acknowledged writes", f["acknowledged"]),
                ("writes with unknown outcome", f["writes_unknown"]),
                ("writes that definitely failed", f["writes_failed"]),
                ("linearizable reads answered", f["lin_reads_ok"]),
                ("local reads answered", f["local_reads_ok"]),
                ("mirror reads answered", f.get("mirror_reads_ok", 0)),
                ("keys checked for linearizability", f["keys_checked"]),
                ("lost acknowledged publishes", f["lost"]),
                ("linearizability violations", f["linearizability_violations"]),
                ("crashed agents / vanished late", f"{f['agent_crashes']} / {f['lease_late']}"),
                (
                    "lease vanish time median / max (s)",
                    f"{bench_report.fmt(f['lease_vanish_s'].get('median'))} / "
                    f"{bench_report.fmt(f['lease_vanish_s'].get('max'))} "
                    f"(bound {f['lease_bound_s']})",
                ),
                ("replicas converged", f["converged"]),
            ],
            ["", ""],
        ),
        "",
        "## Faults",
        "",
        "Unavailability: time from the injection to the first acknowledged write "
        "(linearizable read) whose last attempt began after it; the follower gap is "
        "the longest time without an answered local read on a replica the fault did "
        "not touch, within 3 s of the injection.",
        "",
        bench_report.table(
            [
                (
                    kind,
                    u["count"],
                    u["not_recovered"],
                    _mm(u["write_unavailable_s"]),
                    _mm(u["lin_read_unavailable_s"]),
                    _mm(u["follower_local_read_gap_s"]),
                )
                for kind, u in f["unavailability"].items()
            ],
            [
                "fault",
                "count",
                "not recovered",
                "writes median / max (s)",
                "lin. reads median / max (s)",
                "follower local gap median / max (s)",
            ],
        ),
        "",
        "## Local read staleness per replica (s)",
        "",
        bench_report.table(
            [
                (rep, s.get("n", 0), s.get("median"), s.get("p99"), s.get("max"))
                for rep, s in f["local_staleness_s"].items()
            ],
            ["replica", "reads", "median", "p99", "max"],
        ),
        "",
        "## Verdict",
        "",
        "PASS: no check failed."
        if not data["violations"]
        else "FAIL:\n\n" + "\n".join(f"- {v}" for v in data["violations"]),
        "",
    ]
    return "\n".join(out)


def _t(t: dict[str, Any]) -> dict[str, Any]:
    return {k: t[k] for k in ("key", "name", "goal", "measured", "unit")} | {"passed": t["pass"]}


def _mm(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "-"
    return f"{bench_report.fmt(s['median'])} / {bench_report.fmt(s['max'])}"


def write(
    out: Path,
    cfg: ChaosConfig,
    rep: Report,
    started: dt.datetime,
    wall_s: float,
    stem: str = "report",
) -> dict[str, str]:
    head = bench_report.header(started)
    head["wall_s"] = wall_s
    data = {
        "header": head,
        "config": asdict(cfg),
        "figures": rep.figures,
        "targets": [t.as_dict() for t in targets(rep.figures)],
        "violations": rep.violations,
        "passed": not rep.violations,
    }
    md, js = bench_report.write(out, stem, markdown(data), data)
    return {"markdown": str(md), "json": str(js)}
