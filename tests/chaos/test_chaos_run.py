"""A bounded `kvdir chaos` run per cluster size: every fault kind, every check.

The long run (>= 200 faults) is `kvdir chaos --replicas 5 --faults 200`; its
results are committed under bench/results/ (docs/chaos.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import netns
from bench.chaos.run import FAULT_KINDS
from tests.tools import needs

pytestmark = pytest.mark.integration

WHY = netns.available()


def chaos(out: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", "chaos", "--out", str(out), *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout_s,
    )


@needs(not WHY, WHY or "")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("replicas", "faults"), [(3, 7), (5, 6)])
def test_bounded_chaos_run_passes_every_check(tmp_path: Path, replicas: int, faults: int) -> None:
    p = chaos(
        tmp_path,
        *("--replicas", str(replicas), "--faults", str(faults), "--seed", str(replicas)),
        *("--max-seconds", "180"),
        timeout_s=280,
    )
    data = json.loads((tmp_path / "report.json").read_text())
    f = data["figures"]
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:], data["violations"])
    assert data["violations"] == [] and data["passed"]
    assert f["faults"] == faults
    assert set(f["faults_by_kind"]) == set(FAULT_KINDS[:faults])
    assert f["lost"] == 0 and f["linearizability_violations"] == 0 and f["undecided_keys"] == 0
    assert f["acknowledged"] > 100 and f["lin_reads_ok"] > 100 and f["local_reads_ok"] > 100
    assert f["mirror_reads_ok"] > 100  # a client-side mirror read through every fault
    assert f["mirror_backwards"] == 0 and f["mirror_ahead"] == 0 and f["mirror_phantom"] == 0
    assert f["keys_checked"] >= 4 * 16
    assert f["converged"]
    assert f["agent_crashes"] == f["faults_by_kind"]["agent-crash"] and f["lease_late"] == 0
    kill = f["unavailability"]["kill-leader"]
    assert kill["not_recovered"] == 0 and kill["write_unavailable_s"]["n"] >= 1
    plan = json.loads((tmp_path / "plan.json").read_text())
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    assert plan["prefix"] not in listed  # torn down


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kinds", "kill-leader,meteor"], "unknown fault kinds: meteor"),
        (["--faults", "0"], "--faults must be >= 1"),
        (["--agents", "0"], "--agents must be 1..64"),
    ],
)
def test_bad_arguments_get_one_readable_line(tmp_path: Path, args: list[str], message: str) -> None:
    p = chaos(tmp_path, *args, timeout_s=60)
    assert p.returncode == 1
    assert p.stderr.strip() == f"kvdir: error: {message}" or message in p.stderr.strip()
    assert len(p.stderr.strip().splitlines()) == 1
