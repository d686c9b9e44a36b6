"""`kvdir bench directory --only compaction --quick`: the load, then only the compaction phase.

Checks the mode works end to end on a real 3-replica cluster: every replica
compacts once inside the phase, the report says whether the terms moved and
what the replicas' Raft tick stalls were; no other phase runs. It does not
judge the outcome (a loaded test host may well see an election).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_only_compaction_runs_the_load_and_every_replicas_compaction(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvdir.cli", "bench", "directory", "--only", "compaction"]
    proc = subprocess.run(
        [*cmd, "--quick", "--out-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = list(tmp_path.glob("directory-compaction-*.json"))
    assert len(found) == 1, found
    data = json.loads(found[0].read_text())
    assert "error" not in data, data["error"]
    results = data["results"]
    assert {"publish", "compaction"} <= set(results)
    assert not {"lookup", "failover", "verification", "durability"} & set(results)
    cp = results["compaction"]
    assert {e["replica"] for e in cp["events"]} == {"r1", "r2", "r3"}
    assert isinstance(cp["no_election"], bool)
    assert set(cp["raft_stall_longest_across"]) == {"r1", "r2", "r3"}
    assert isinstance(cp["raft_stall_gap_ms_max_across"], int | float)
    assert [p["phase"] for p in results["phases"]] == ["publish load", "compaction"]
    assert "No election across compaction" in proc.stdout
