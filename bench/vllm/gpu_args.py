"""The flags `kvdir bench vllm --device cuda` adds (bench/vllm/gpu.py), importable without CUDA."""

from __future__ import annotations

import argparse

PARTS = ("8b", "70b", "peer")
"""8b: four engines of the 8B shape (CUDA IPC and host-path pulls, every check);
70b: two engines of the 70B shape cut to 20 layers (a CUDA IPC pull);
peer: vLLM's OffloadingConnector next to kvdir's own pool, on the 70B shape."""
SHAPE_PARTS = {"8b": ("8b",), "70b-20l": ("70b",)}
"""--shape, kept from before --only: the part that runs that shape."""
MEMORY_SHARE = 0.2
"""Of the GPU's memory, per engine of the 8B part (four engines and three GPU tiers)."""
POOL_SLOTS = 3072
"""Per agent of the 8B part: 6 GiB of the 8B shape's 2 MiB blocks in device memory."""
PAIR_MEMORY_SHARE = 0.38
"""Per engine of the two-engine parts: ~36 GiB of 70B-shape weights (20 layers of
1.7 GB, two 2.1 GB embeddings) leave ~14 GiB of KV cache each on a 140 GiB H200."""
PAIR_POOL_SLOTS = 4096
"""Per agent of the two-engine parts: 5 GiB of the 70B shape's 1.25 MiB blocks."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only", choices=PARTS, nargs="+", default=None,
        help="--device cuda: the parts to run (default: all; 8b, then 70b and peer)",
    )  # fmt: skip
    p.add_argument(
        "--shape", choices=tuple(SHAPE_PARTS), default=None,
        help="--device cuda: the part of that shape only (8b: --only 8b; 70b-20l: --only 70b)",
    )  # fmt: skip
    p.add_argument("--memory-share", type=float, default=MEMORY_SHARE, help="--device cuda: 8b")
    p.add_argument(
        "--pool-slots", type=int, default=POOL_SLOTS, help="--device cuda: 8b, per agent"
    )
    p.add_argument(
        "--pair-memory-share", type=float, default=PAIR_MEMORY_SHARE,
        help="--device cuda: per engine of the 70b and peer parts",
    )  # fmt: skip
    p.add_argument(
        "--pair-pool-slots", type=int, default=PAIR_POOL_SLOTS,
        help="--device cuda: per agent of the 70b and peer parts",
    )  # fmt: skip
    p.add_argument("--skip-checks", action="store_true", help="--device cuda: measure only")
    p.add_argument(
        "--no-async-scheduling", action="store_true",
        help="--device cuda: 8b: every engine without vLLM's async scheduling (its default)",
    )  # fmt: skip
    p.add_argument(
        "--work-dir", default=None, help="logs (and pools) kept here (default: a temporary folder)"
    )


def parts_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The parts to run, in PARTS order: --only and --shape together select their union."""
    chosen = set(args.only or ())
    if args.shape:
        chosen.update(SHAPE_PARTS[args.shape])
    return tuple(p for p in PARTS if p in chosen) if chosen else PARTS
