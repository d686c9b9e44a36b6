"""`kvdir bench transfer --quick` runs end to end and reports every section.

This checks that the benchmark works (a real 3-replica directory, three real
agents, tcp and shm fetches checked byte for byte, the raw baselines) and
that its JSON carries a finite number for every measurement; it does not
judge the speed. It also checks that the temp dir of the pool files is gone.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

FETCH_PATHS: list[tuple[str, ...]] = [
    ("bytes",),
    ("blocks",),
    ("tcp_vs_raw_socket",),
    ("shm_vs_memcpy",),
    *[
        (kind, stat)
        for kind in (
            "tcp",
            "tcp_agent",
            "shm",
            "shm_agent",
            "raw_socket",
            "raw_socket_product_buffers",
            "memcpy",
        )
        for stat in ("median_ms", "min_ms", "gbps_median")
    ],
]

REQUIRED: dict[str, list[tuple[str, ...]]] = {
    "fixed_overhead": [
        (kind, stat)
        for kind in ("tcp", "tcp_agent", "shm", "shm_agent", "engine_rpc", "directory_lookup")
        for stat in ("median_ms", "p90_ms", "min_ms")
    ],
    "stored_enqueue": [
        (f"{call}_batch_{batch}{mode}", stat)
        for call in ("stored", "empty_call")
        for batch in (1, 16)
        for mode in ("", "_paced")
        for stat in ("p50_us", "p99_us", "max_us")
    ],
    "visibility": [
        ("stored", "reader_lookup", "median_ms"),
        ("stored", "reader_lookup", "p99_ms"),
        ("stored", "all_replicas", "p99_ms"),
        ("stored", "timeouts"),
        ("publish", "reader_lookup", "median_ms"),
        ("publish", "reader_lookup", "p99_ms"),
        ("publish_rpc", "median_ms"),
    ],
}


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = d
    for p in path:
        assert isinstance(cur, dict) and p in cur, f"missing {'.'.join(path)}"
        cur = cur[p]
    return cur


def _number(v: Any, where: object) -> None:
    assert isinstance(v, int | float) and not isinstance(v, bool), (where, v)
    assert math.isfinite(v), (where, v)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_bench_writes_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdir.cli",
            "bench",
            "transfer",
            "--quick",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = list(tmp_path.glob("transfer-*.json"))
    assert len(found) == 1, found
    assert found[0].with_suffix(".md").exists()
    data = json.loads(found[0].read_text())
    assert "error" not in data, data["error"]

    header = data["header"]
    for key in ("cpu_model", "cores", "memory_bytes", "python"):
        assert header["machine"][key]
    assert "bench transfer --quick" in header["command"]
    assert header["started_utc"].endswith("Z")

    results = data["results"]
    fetch = results["fetch"]
    assert {row["block_tokens"] for row in fetch} == {16, 512}
    for row in fetch:
        assert row["verified"] is True
        for path in FETCH_PATHS:
            _number(_get(row, path), ("fetch", row["block_tokens"], path))
    for section, paths in REQUIRED.items():
        assert section in results, f"no {section} section"
        for path in paths:
            _number(_get(results[section], path), (section, path))
    assert results["visibility"]["stored"]["timeouts"] == 0

    targets = {t["key"]: t for t in data["targets"]}
    gated = [k for k in targets if k.startswith(("tcp_vs_", "shm_vs_"))]
    assert len(gated) == 2 * len(fetch)
    for key in [*gated, "stored_p99_batch_1", "stored_p99_batch_16", "visible_p99"]:
        _number(targets[key]["measured"], key)
        assert isinstance(targets[key]["pass"], bool), key
    for key in ("fixed_overhead_tcp", "fixed_overhead_shm"):
        _number(targets[key]["measured"], key)
    assert "| Target | Goal | Measured | Result |" in proc.stdout
    base = re.search(r"under (\S*kvdir-bench-transfer-\S+)", proc.stderr)
    assert base is not None, proc.stderr[-2000:]
    assert not os.path.exists(base.group(1)), "the benchmark left its pool dir behind"
