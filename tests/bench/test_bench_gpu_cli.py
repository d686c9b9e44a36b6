"""`kvdir bench gpu` without torch: one readable line and a non-zero exit.

(The experiment itself is covered by tests/gpu, on a GPU machine, and by its
CPU dry run where torch is installed.)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None, reason="torch installed: the dry run applies"
)
def test_without_torch_the_command_says_what_it_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvdir.cli", "bench", "gpu", "--gpu-a", "-1", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("kvdir: error: the GPU experiment needs torch")
    assert done.stderr.count("\n") == 1
