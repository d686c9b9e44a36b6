"""Where `kvdir bench|chaos|fuzz` come from: the tools of a source checkout.

The benchmarks, the chaos suite and the fuzzers live in bench/ at the root of
the repository, apart from the product, and the wheel does not install them.
Run from a checkout (the kvdir package found next to bench/), the command puts
the checkout first on the import path, for itself and for the processes the
tools start (they run `python -m bench....`); elsewhere it says so in one line.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

CHECKOUT = Path(__file__).resolve().parents[1]
"""The repository root when this package is a source checkout (kvdir/ sits in it)."""


class ToolsMissing(RuntimeError):
    """The tools were asked for where they are not installed (a wheel, not a checkout)."""


def available() -> bool:
    return all((CHECKOUT / name).is_file() for name in ("bench/__init__.py", "pyproject.toml"))


def load(module: str, what: str) -> ModuleType:
    """Import `module` (under bench/) from the checkout, or raise ToolsMissing."""
    if not available():
        raise ToolsMissing(
            f"`kvdir {what}` runs from a source checkout of kvdir: bench/ (benchmarks, chaos, "
            "fuzz) is not installed with the package"
        )
    root = str(CHECKOUT)
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p]])
    return importlib.import_module(module)
