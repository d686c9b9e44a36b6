"""`kvdir bench replay` and `kvdir demo` run end to end on a tiny trace.

This proves the commands work (a real 3-replica directory, real agents per
scenario, real bytes stored and fetched and checked byte for byte, the
Markdown, JSON and PNG outputs); it does not judge the figures, except the
ones that must hold whatever the machine: no wrong bytes, the agents' pools
agreeing with the model, and exactly the model-only hit rate for A (no pulls,
so nothing can race). Bad input fails fast with one readable line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdir.replay.trace import synthesize, to_jsonl

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _kvdir(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _trace(tmp_path: Path, conversations: int = 14) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(to_jsonl(synthesize(conversations=conversations, seed=5))) + "\n")
    return p


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replay_writes_table_json_and_plots(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    proc = _kvdir(
        "bench", "replay", "--trace", str(trace), "--nodes", "3", "--kv-gib-per-node", "16",
        "--gpus-per-node", "1", "--sweep-nodes", "2,3", "--out", str(tmp_path),
        "--stem", "r", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "r.json").read_text())
    assert "bench replay" in data["header"]["command"]
    rows = {r["scenario"]: r for r in data["scenarios"]}
    assert set(rows) == {"A", "B", "C", "C-rdma", "D", "ideal"}
    assert rows["ideal"]["hit_rate"] == 1.0
    assert rows["A"]["real"]["fetches"] == 0
    for key, transport in (("B", "tcp"), ("C", "shm"), ("C-rdma", "shm"), ("D", "shm")):
        real = rows[key]["real"]
        assert real["fetches"] > 0 and real["bytes"] > 0, key
        assert real["transports"] == [transport], key
        assert real["wrong_blocks"] == 0, key
    for row in rows.values():
        assert row["real"]["model_mismatches"] == 0, row["scenario"]
        assert row["requests"] == rows["ideal"]["requests"]
    check = data["model_check"]["A"]
    assert check["real"] == check["model"]
    assert set(data["sweep"]) and all(set(p) == {"2", "3"} for p in data["sweep"].values())
    assert {t["key"] for t in data["targets"]} >= {"hit_gap_C", "a_vs_expected", "wrong_blocks"}
    md = (tmp_path / "r.md").read_text()
    assert "| A: local cache only, random routing |" in md
    assert "RDMA 400 Gbit/s (modelled)" in md
    for png in ("r-ttft.png", "r-nodes.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
    assert "### Scenarios" in proc.stdout


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_prints_the_table_and_passes() -> None:
    proc = _kvdir("demo", "--nodes", "3", "--conversations", "12", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| scenario | hit rate (reusable blocks) |" in proc.stdout
    assert "D: affinity routing + pool" in proc.stdout
    assert "no wrong bytes" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "/nonexistent/t.jsonl"], "no such trace file"),
        (["--scenarios", "A,Z"], "unknown scenarios"),
        (["--nodes", "0"], "--nodes"),
        (["--sweep-nodes", "2,x"], "comma-separated"),
        (["--model", "gpt-9"], "unknown model shape"),
        (["--kv-gib-per-node", "0.1"], "less than the longest request"),
        (["--block-bytes", "100"], "--block-bytes"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = _kvdir("bench", "replay", "--out", str(tmp_path), *args, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())


def test_malformed_trace_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{x\n')
    proc = _kvdir("bench", "replay", "--trace", str(p), "--out", str(tmp_path / "o"), timeout=60)
    assert proc.returncode == 2
    assert f"{p}:2: not JSON" in proc.stderr
