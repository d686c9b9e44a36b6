"""`kvdir sim`'s long-run tooling: --out per-seed JSON, --budget-s, --merge --report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.report import seed_ranges
from kvdir.cli import main

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning"
)


def test_pieces_merge_into_one_report(tmp_path: Path) -> None:
    a, b, md = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "r.md"
    assert main(["sim", "--seed", "1", "--seeds", "2", "--steps", "120", "--out", str(a)]) == 0
    assert main(["sim", "--seed", "3", "--seeds", "2", "--steps", "120", "--out", str(b)]) == 0
    doc = json.loads(a.read_text())
    assert [s["seed"] for s in doc["seeds"]] == [1, 2]
    assert {"commit", "machine", "started", "cpu_s", "load_start", "command"} <= set(doc)
    assert all(s["steps"] >= 120 and not s["failed"] for s in doc["seeds"])
    assert main(["sim", "--merge", str(a), str(b), "--report", str(md)]) == 0
    text = md.read_text()
    assert "Seeds covered: 1-4** (contiguous)" in text
    assert "**Failed: 0**" in text and "raft-sim-2026-12-03.md" in text


def test_a_spent_budget_starts_no_more_seeds(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    args = ["sim", "--seeds", "500", "--steps", "100", "--budget-s", "0.5", "--out", str(out)]
    assert main(args) == 0
    seeds = [s["seed"] for s in json.loads(out.read_text())["seeds"]]
    assert len(seeds) < 500 and seeds == list(range(1, len(seeds) + 1))


def test_runs_of_different_shapes_do_not_merge(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["sim", "--seeds", "1", "--steps", "100", "--out", str(a)]) == 0
    assert main(["sim", "--seed", "2", "--seeds", "1", "--steps", "110", "--out", str(b)]) == 0
    assert main(["sim", "--merge", str(a), str(b)]) == 2


def test_seed_ranges() -> None:
    assert seed_ranges([5, 1, 2, 3, 9, 10]) == "1-3, 5, 9-10"
    assert seed_ranges([]) == ""
