"""Tests that need a tool `.ci/run` installs: skipped locally, failed under CI.

A missing tool on a developer's machine is a reason to skip; in CI it means an
install step broke, and a silent skip would hide that.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])


def needs(available: bool, why: str) -> Callable[[F], F]:
    """Mark a test that runs only where `available`; under CI its absence fails."""

    def deco(test: F) -> F:
        if available:
            return test
        if os.environ.get("CI"):

            @functools.wraps(test)
            def failing(*args: Any, **kwargs: Any) -> None:
                pytest.fail(f"{why} (CI installs it: scripts/install-test-deps.sh)")

            return failing  # type: ignore[return-value]
        return pytest.mark.skip(reason=why)(test)  # type: ignore[no-any-return]

    return deco


def unavailable(why: str) -> NoReturn:
    """Inside a test or fixture: skip for `why` locally, fail under CI (as `needs`)."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI installs it: scripts/install-test-deps.sh)")
    pytest.skip(why)
