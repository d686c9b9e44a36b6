"""scripts/slowest.py: one list of the slowest tests over `make test`'s two pytest runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slowest.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slowest", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _junit(path: Path, cases: dict[str, float]) -> str:
    rows = "".join(
        f'<testcase classname="tests.m" name="{n}" time="{t}"/>' for n, t in cases.items()
    )
    path.write_text(f'<testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return str(path)


def test_merges_both_runs_slowest_first_and_names_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slowest = _load()
    rest = _junit(tmp_path / "rest.xml", {"a": 1.5, "b": 30.25, "c": 0.5})
    vm = _junit(tmp_path / "vm.xml", {"powercut": 400.0, "config": 2.0})
    assert slowest.main(["3", rest, vm, str(tmp_path / "never-written.xml")]) == 0
    out, err = capsys.readouterr()
    listed = [line.split()[-1] for line in out.splitlines()[1:]]
    assert listed == ["tests.m::powercut", "tests.m::b", "tests.m::config"]
    assert "of 5" in out.splitlines()[0]
    assert "never-written.xml" in err


def test_refuses_a_missing_count() -> None:
    assert _load().main(["many", "x.xml"]) == 2
