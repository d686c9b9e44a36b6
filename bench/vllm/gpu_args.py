"""The flags `kvdir bench vllm --device cuda` adds (bench/vllm/gpu.py), importable without CUDA."""

from __future__ import annotations

import argparse

SHAPE_NAMES = ("70b-20l", "8b")
MEMORY_SHARE = 0.2
"""Of the GPU's memory, per engine (four engines and three GPU tiers share one GPU)."""
POOL_SLOTS = 3072
"""Per agent: 6 GiB of the 8B shape's 2 MiB blocks in device memory."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=SHAPE_NAMES, default="8b", help="--device cuda: model shape")
    p.add_argument("--memory-share", type=float, default=MEMORY_SHARE, help="--device cuda")
    p.add_argument("--pool-slots", type=int, default=POOL_SLOTS, help="--device cuda: per agent")
    p.add_argument("--skip-checks", action="store_true", help="--device cuda: measure only")
    p.add_argument(
        "--work-dir", default=None, help="--device cuda: logs and pools, kept (default: temp)"
    )
