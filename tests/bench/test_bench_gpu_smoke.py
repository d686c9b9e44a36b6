"""The GPU experiment's CPU dry run works end to end (bench/gpu, docs/gpu.md).

`--gpu-a -1 --gpu-b -1` runs two real node processes on the CPU with a tiny
model: kvdir pools, tcp reads of the holder's blocks, header validation,
eviction detection and the logits comparison; everything but the cuda path
(tests/gpu covers that on a GPU). Skipped without torch (CI has none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the experiment's engine needs torch (CI has none)")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_cpu_dry_run_fetches_validates_and_matches(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu.experiment",
            "--run",
            "tiny=64,128",
            "--gpu-a",
            "-1",
            "--gpu-b",
            "-1",
            "--reps",
            "1",
            "--new",
            "16",
            "--out",
            str(out),
            "--pool-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = out.glob("gpu-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["context"] for r in rows] == [64, 128]
    for r in rows:
        tcp = r["tcp"]
        assert tcp["valid_blocks"] == r["blocks"] == r["context"] // 16
        assert tcp["bytes"] == r["bytes"] > 0
        assert tcp["logits_equal_chunked"] and tcp["kv_equal_chunked"]
        assert tcp["logits_cosine"] > 0.99
        assert r["invalidation"]["passed"], r["invalidation"]
    assert not list(tmp_path.glob("kvdir-gpu-exp-*")), "pool files left behind"
