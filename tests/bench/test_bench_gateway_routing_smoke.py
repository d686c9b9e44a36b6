"""`kvdir bench gateway` and `kvdir bench routing` run end to end at a tiny size.

Proves the commands work and report numbers (not how fast anything is): the
gateway benchmark with real processes (a directory replica, echo backends, the
routing and pass-through `kvdir gateway` daemons), the routing one on a small
trace written here in the Mooncake format.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout_s: float) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvdir.cli", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_gateway_tiny(tmp_path: Path) -> None:
    _run(
        [
            "gateway",
            "--rate",
            "40",
            "--seconds",
            "1",
            "--warmup-s",
            "0.5",
            "--rounds",
            "1",
            "--prompt-tokens",
            "1024",
            "--extra-rates",
            "20",
            "--workers",
            "2",
            "--out",
            str(tmp_path),
        ],
        170,
    )
    (js,) = tmp_path.glob("gateway-*.json")
    data = json.loads(js.read_text())
    for side in ("passthrough", "gateway"):
        assert data[side]["n"] == 40 and math.isfinite(data[side]["p99_ms"])
    assert math.isfinite(data["added"]["p99_ms"]) and data["decisions"] >= 80
    (other,) = data["other_rates"]
    assert other["rate"] == 20 and other["gateway"]["n"] == 20
    assert data["workers"] == 2 and js.name.endswith("-workers2.json")
    for side in ("passthrough", "gateway"):  # both workers' CPU, per request
        assert data["cpu"][side]["proxy_cpu_s"] > 0, data["cpu"]
    assert (tmp_path / js.name.replace(".json", ".md")).read_text().startswith("# kvdir bench")


@pytest.mark.timeout(120)
def test_bench_routing_tiny(tmp_path: Path) -> None:
    rng = random.Random(3)
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(300):
        conv = rng.randrange(20)
        blocks = [0, 1000 + conv] + [10_000 + i * 10 + k for k in range(rng.randrange(0, 4))]
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 100,
                    "input_length": 512 * len(blocks) - 7,
                    "output_length": 50,
                    "hash_ids": blocks,
                }
            )
        )
    trace.write_text("\n".join(lines) + "\n")
    _run(
        [
            "routing",
            "--trace",
            str(trace),
            "--nodes",
            "4",
            "--capacity-gib",
            "0",
            "1",
            "--out",
            str(tmp_path),
        ],
        110,
    )
    (js,) = tmp_path.glob("routing-*.json")
    data = json.loads(js.read_text())
    assert 0 < data["ideal_hit_rate"] < 1 and len(data["sweeps"]) == 2
    for sw in data["sweeps"]:
        by = {r["policy"]: r for r in sw["results"]}
        assert set(by) == {"random", "round-robin", "least-loaded", "affinity", "affinity+pool"}
        # no policy beats one infinite shared cache
        assert all(r["hit_rate"] <= data["ideal_hit_rate"] + 1e-12 for r in by.values())
