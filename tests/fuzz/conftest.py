"""Fixtures of the fuzz tier: the real daemons of `kvdir fuzz` (bench/fuzz/harness.py)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from bench.fuzz.harness import Harness

CASES = int(os.environ.get("KVDIR_FUZZ_CASES", "25"))
"""Examples per target in CI (`kvdir fuzz --cases N` for long runs)."""


@pytest.fixture(scope="session")
def seed() -> int:
    """One seed per session, printed on failure (KVDIR_FUZZ_SEED repeats a run)."""
    return int(os.environ.get("KVDIR_FUZZ_SEED", random.randrange(1 << 32)))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(str(tmp_path_factory.mktemp("fuzz")))
    try:
        h.start()
        yield h
    finally:
        h.stop()
