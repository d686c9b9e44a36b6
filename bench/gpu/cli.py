"""`kvdir bench gpu`: the H200 prefill-versus-fetch experiment (docs/gpu.md).

The experiment itself lives in `bench/gpu/` (a paged-KV engine with random
weights, not the product), so this command runs from a source checkout on a
machine with CUDA, torch and CuPy; it takes the flags of
`python -m bench.gpu.experiment` (``--run``, ``--gpu-a``, ``--gpu-b``,
``--reps``, ``--out``, ``--tag``; ``--gpu-a -1`` is a CPU dry run).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any

from kvdir.report import REPO_ROOT


def _unavailable(reason: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        print(f"kvdir: error: the GPU experiment {reason}", file=sys.stderr)
        return 2

    return run


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "gpu",
        help="prefill vs. fetch (recompute, TCP, CUDA IPC) on a GPU (docs/gpu.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The experiment is in the checkout's top-level `bench/` package, which an
    # installed wheel does not carry.
    if (REPO_ROOT / "bench" / "gpu").is_dir() and str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    try:
        experiment = importlib.import_module("bench.gpu.experiment")
    except ImportError as e:
        p.add_argument("experiment_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_unavailable(f"needs a source checkout ({e})"))
        return
    experiment.add_arguments(p)
    if importlib.util.find_spec("torch") is None:
        p.set_defaults(func=_unavailable("needs torch (and CUDA with CuPy for the GPU runs)"))
        return

    def run(args: argparse.Namespace) -> int:
        try:
            rc: int = experiment.run_args(args)
        except experiment.NodeError as e:
            print(f"kvdir: error: {e}", file=sys.stderr)
            return 1
        return rc

    p.set_defaults(func=run)
