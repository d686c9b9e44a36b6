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


@needs_promtool
def test_rdma_errors_alert_fires_on_a_stream_not_on_one_error(tmp_path: Path) -> None:
    """promtool's rule unit tests on KvdirAgentRdmaErrors (annotations stripped: templates)."""
    import yaml

    doc = yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
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
