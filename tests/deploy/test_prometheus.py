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
