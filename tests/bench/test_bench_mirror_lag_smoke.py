"""`python -m bench.mirror_lag` runs end to end on a small preload.

This proves the command works (a real 3-replica directory, a real mirror fed
by a Watch stream, paced publishes from the client processes); it does not
judge the lag, only what must hold on any machine: every publish succeeded,
the mirror reached every acknowledged index, and the table grew by exactly
what was published. Bad input fails fast with one readable line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.mirror_lag", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.timeout(200)
def test_small_preload_and_one_lag_run() -> None:
    p = _run("--preload", "20000", "--rate", "5000", "--repeat", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["preload"]["entries"] == 20_000
    (run,) = out["runs"]
    assert run["publishes"] == 40 and run["publishes_failed"] == 0, run
    assert run["never_seen"] == 0
    assert run["entries_after"] - run["entries_before"] == 40 * run["batch_entries"]
    assert run["lag_ms"]["n"] == 40
    assert not Path(out["dir"]).exists()  # a run that succeeded leaves no journals behind


def test_bad_input_is_one_line() -> None:
    p = _run("--repeat", "0")
    assert p.returncode == 2
    assert "--repeat 1..10" in p.stderr.strip().splitlines()[-1]
