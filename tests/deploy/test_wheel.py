"""The built wheel installs one top-level package, `kvdir`, and imports in a fresh venv.

kvdir is installed into other programs' environments (a vLLM server's), where
top-level names such as `directory` or `agent` would collide. The repository
keeps its top-level folders; kvdir/ reaches them through symlinks, which the
build must follow so the wheel holds real files under kvdir/ and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = {"core", "directory", "agent", "transfer", "v1", "gateway", "routing", "replay"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (whl,) = out.glob("kvdir-*.whl")
    return whl


def test_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"kvdir"}
    subpackages = {n.split("/")[1] for n in names if n.count("/") >= 2}
    assert subpackages >= PRODUCT_PACKAGES
    assert not {"bench", "chaos", "fuzz"} & subpackages  # the tools stay in the checkout
    assert "kvdir/directory/table.py" in names and "kvdir/v1/directory.proto" in names


def test_installs_and_imports_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    # Installed into an empty target; the probe runs isolated (-I: no checkout, no
    # PYTHONPATH) with the target first on its path, taking kvdir's dependencies
    # from this interpreter (no network here).
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed == {"kvdir", "bin"}  # bin/: the `kvdir` console script
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import kvdir, kvdir.directory.table, kvdir.core.wire, kvdir.v1.directory_pb2; "
        "print(kvdir.__file__); "
        "print(sorted(m for m in sys.modules if m in ('directory', 'agent', 'transfer', 'proto')))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(target)],
        check=True, timeout=120, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    first, second = out.stdout.splitlines()
    assert first.startswith(str(target))
    assert second == "[]"
