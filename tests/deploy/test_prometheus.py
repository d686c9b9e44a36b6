"""deploy/prometheus and deploy/grafana: promtool accepts the config and rules."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.tools import needs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL = shutil.which("promtool")

needs_promtool = needs(PROMTOOL is not None, "promtool is missing (Debian's prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], check=False, capture_output=True, text=True, timeout=60
    )


@needs_promtool
def test_scrape_config_and_rules_are_valid() -> None:
    r = _promtool("check", "config", str(DEPLOY / "prometheus/prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = _promtool("check", "rules", str(DEPLOY / "prometheus/rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    """Each dashboard query, as a rule, through promtool's PromQL parser."""
    from tests.deploy.names import dashboard_exprs

    exprs = dashboard_exprs(DEPLOY / "grafana/kvdir.json")
    assert exprs
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dash:q{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    f = tmp_path / "dashboard-rules.json"  # promtool reads YAML, and JSON is YAML
    f.write_text(json.dumps(rules))
    r = _promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


def _rules_without_annotations(tmp_path: Path) -> Path:
    """deploy's rules with annotations stripped (templates; promtool's unit tests
    would have to spell each one out)."""
    import yaml

    doc = yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
    return rules


@needs_promtool
def test_rdma_errors_alert_fires_on_a_stream_not_on_one_error(tmp_path: Path) -> None:
    """promtool's rule unit tests on KvdirAgentRdmaErrors."""
    import yaml

    rules = _rules_without_annotations(tmp_path)
    series = (
        'kvdir_agent_rdma_errors_total{{instance="{}",job="kvdir-agent",kind="{}",status="{}"}}'
    )
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # a deadline flush every minute: a peer or the link keeps failing
                    {"series": series.format("n1:7302", "deadline", ""), "values": "0+1x40"},
                    # no rdma errors at all (or no rdma): zeros
                    {"series": series.format("n2:7302", "completion", ""), "values": "0x40"},
                    # one stale-rkey error, once (a peer restarted mid-read)
                    {
                        "series": series.format("n3:7302", "completion", "IBV_WC_REM_ACCESS_ERR"),
                        "values": "0 1x39",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "8m", "alertname": "KvdirAgentRdmaErrors", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "KvdirAgentRdmaErrors",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "instance": "n1:7302",
                                    "kind": "deadline",
                                }
                            }
                        ],
                    },
                ],
            }
        ],
    }
    f = tmp_path / "rdma-alert-test.yml"
    f.write_text(yaml.safe_dump(tests))
    r = _promtool("test", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_directory_alerts_are_per_raft_group(tmp_path: Path) -> None:
    """Two groups of a sharded directory (docs/sharding.md): g1 has no leader while
    g0 has one, and g1's commit index is far below g0's (each group counts its own).
    Only g1 is leaderless, only g0's slow replica lags, and only the replica on an
    old shard map routes by it."""
    import yaml

    rules = _rules_without_annotations(tmp_path)
    replicas = {  # instance: (group, role, commit index, shard map version)
        "a0:7201": ("g0", 2, 50_000, 2),
        "a1:7201": ("g0", 0, 50_000, 2),
        "a2:7201": ("g0", 0, 30_000, 2),  # 20,000 behind its leader
        "b0:7201": ("g1", 1, 500, 2),  # a candidate, no leader
        "b1:7201": ("g1", 0, 500, 2),
        "b2:7201": ("g1", 0, 500, 1),  # an old shard map
    }
    base = 'job="kvdir-directory",cluster="kvdir",instance="{}"'
    input_series = []
    for inst, (group, role, commit, version) in replicas.items():
        labels = base.format(inst)
        for name, value in (
            ("kvdir_directory_raft_role", role),
            ("kvdir_directory_raft_commit_index", commit),
            ("kvdir_directory_raft_applied_index", commit),
            ("kvdir_directory_shard_map_version", version),
        ):
            input_series.append({"series": f"{name}{{{labels}}}", "values": f"{value}x20"})
        input_series.append(
            {"series": f'kvdir_directory_shard_group{{{labels},group="{group}"}}', "values": "1x20"}
        )
    common = {"cluster": "kvdir", "severity": "critical"}
    replica = {"cluster": "kvdir", "job": "kvdir-directory", "severity": "warning"}
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": "KvdirDirectoryNoLeader",
                        "exp_alerts": [{"exp_labels": {**common, "group": "g1"}}],
                    },
                    {
                        "eval_time": "10m",
                        "alertname": "KvdirDirectoryReplicaLag",
                        "exp_alerts": [
                            {"exp_labels": {**replica, "instance": "a2:7201", "group": "g0"}}
                        ],
                    },
                    {
                        "eval_time": "10m",
                        "alertname": "KvdirDirectoryShardMapBehind",
                        "exp_alerts": [{"exp_labels": {**replica, "instance": "b2:7201"}}],
                    },
                ],
            }
        ],
    }
    f = tmp_path / "group-alerts-test.yml"
    f.write_text(yaml.safe_dump(tests))
    r = _promtool("test", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr
