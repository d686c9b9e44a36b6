"""Two nodes on one GPU through the product path: directory, agents, cuda transport.

A real `kvdir directory serve`, two `kvdir agent serve` with a GPU-tier pool
(transports tcp,shm,cuda) and two worker processes holding vLLM-shaped
per-layer KV caches (bench/gpu/product_node.py). Node A prefills and saves
through its GPU tier; node B's agent finds A in the directory, reads A's GPU
slots over CUDA IPC and validates A's headers; B loads them into its vLLM
blocks: byte-identical. A block A reuses after the directory recorded it
ends B's valid prefix exactly there.

Skipped without CuPy or a CUDA GPU (CI). Device runs: bench/results/.
"""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("cupy", reason="the GPU path needs CuPy (CI has no GPU)")
torch = pytest.importorskip("torch", reason="the workers hold torch CUDA tensors")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)

from bench.gpu.product import run_shape  # noqa: E402


def test_blocks_saved_by_a_load_on_b_byte_identical_and_reuse_is_caught() -> None:
    a = argparse.Namespace(new=16, reps=2, pool_dir="/dev/shm")
    rows = run_shape("tiny", 0, [256], a)
    (r,) = rows
    assert r["byte_identical"], "B's fetched blocks differ from A's"
    assert r["fetch"]["valid"] == r["blocks"] == 16
    assert r["fetch"]["transport"] == "cuda"
    race = r["race"]
    assert race["detected"], race
    assert r["local_race"] == {"valid": 3, "reused": 3}
    assert not r["shutdown"]["shutdown_hangs"], "an agent outlived its SIGTERM"
