"""kvdir inside real vLLM engines on a GPU: KV loaded into vLLM's GPU cache equals recompute.

Runs bench/vllm/gpu.py's checks with one short measurement row: a 3-replica
directory, agents with GPU-tier pools, vLLM 0.24 engines that compute and save
(a), pull over CUDA IPC (b) and over the host path (c), and a plain engine (n)
whose recompute is the reference. Every check (same answer, the load's path,
tenants never sharing, a reused slot caught, agent and directory failures
degrading to recompute) must pass.

Skipped without a CUDA GPU, CuPy or vLLM 0.24 (CI has none of them); the device
run's output is committed under bench/results/ (vllm-gpu-*.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="the GPU tier needs CuPy (CI has no GPU)")
torch = pytest.importorskip("torch", reason="vLLM's caches are torch tensors")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)
vllm = pytest.importorskip("vllm", reason="needs vLLM 0.24 (the H200 bundle)")
if not vllm.__version__.startswith("0.24."):
    pytest.skip(f"vLLM {vllm.__version__}: the GPU tier runs vLLM 0.24", allow_module_level=True)

from bench.vllm.gpu import main  # noqa: E402

pytestmark = [pytest.mark.timeout(1200)]


def test_real_vllm_engines_load_kvdir_blocks_into_their_gpu_caches(tmp_path: Path) -> None:
    rc = main(
        ["--tokens", "1024", "--repeats", "1", "--out", str(tmp_path), "--note", "pytest tier"]
    )
    (result,) = tmp_path.glob("vllm-gpu-*.json")
    data = json.loads(result.read_text())
    failed = {c["check"]: c for c in data["checks"] if not c["ok"]}
    assert not failed, failed
    assert {c["check"] for c in data["checks"]} == {
        "ipc", "host", "tenants", "reuse", "agent_killed", "directory_down",
    }  # fmt: skip
    (row,) = data["summary"]
    assert row["correct"] and row["cached_min"] >= 1024
    assert {"cuda", "tcp"} <= set(row["sources"])
    assert rc == 0
