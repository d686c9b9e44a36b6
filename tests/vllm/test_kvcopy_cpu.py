"""The CPU engine's block mover moves blocks byte for byte (tests/vllm/kvcopy_check.py).

Run under the vLLM CPU venv's Python, which has torch (the test venv does not).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.vllm.engines import REPO, vllm_python

pytestmark = [pytest.mark.timeout(120)]


def test_cpu_block_mover_round_trips_contiguous_and_strided_layouts() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [str(vllm_python()), "-m", "tests.vllm.kvcopy_check"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
