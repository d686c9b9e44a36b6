"""The agent's directory_mirror settings: defaults, bounds, clear errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvdir.agent.config import (
    DIRECTORY_MIRROR_STALENESS_MS_MAX,
    DIRECTORY_MIRROR_STALENESS_MS_MIN,
    from_dict,
)
from kvdir.core.config import ConfigError

BASE: dict[str, Any] = {
    "node_id": "n1",
    "host": "127.0.0.1",
    "directory": "127.0.0.1:1",
    "listen": "127.0.0.1:2",
    "engine_socket": "/tmp/kvdir-test-never-bound.sock",
    "pools": [{"model": "m", "block_tokens": 16, "slot_bytes": 4096, "slots": 4}],
}


def test_the_mirror_is_on_by_default_with_the_gateways_staleness() -> None:
    cfg = from_dict(BASE)
    assert cfg.directory_mirror is True
    assert cfg.directory_mirror_staleness_ms == 1000


def test_the_bounds_are_accepted_and_the_mirror_can_be_turned_off() -> None:
    for ms in (DIRECTORY_MIRROR_STALENESS_MS_MIN, DIRECTORY_MIRROR_STALENESS_MS_MAX):
        assert from_dict({**BASE, "directory_mirror_staleness_ms": ms}).directory_mirror
    assert from_dict({**BASE, "directory_mirror": False}).directory_mirror is False


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("directory_mirror_staleness_ms", 0, "directory_mirror_staleness_ms must be an integer"),
        ("directory_mirror_staleness_ms", DIRECTORY_MIRROR_STALENESS_MS_MIN - 1, "100..60000"),
        ("directory_mirror_staleness_ms", DIRECTORY_MIRROR_STALENESS_MS_MAX + 1, "100..60000"),
        ("directory_mirror_staleness_ms", 1.5, "(got 1.5)"),
        ("directory_mirror_staleness_ms", "1000", "(got '1000')"),
        ("directory_mirror_staleness_ms", True, "(got True)"),
        ("directory_mirror", "yes", "directory_mirror must be true or false, not 'yes'"),
        ("directory_mirror", 1, "directory_mirror must be true or false"),
    ],
)
def test_bad_mirror_settings_are_refused_clearly(key: str, value: object, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict({**BASE, key: value})
    assert text in str(err.value)


@pytest.mark.timeout(60)
def test_the_cli_refuses_a_bad_staleness_before_starting() -> None:
    r = subprocess.run(
        [
            sys.executable, "-m", "kvdir.cli", "agent", "serve", "--node-id", "n1",
            "--host", "127.0.0.1", "--directory", "127.0.0.1:1", "--listen", "127.0.0.1:2",
            "--engine-socket", "/tmp/kvdir-test-never-bound.sock",
            "--pool", "model=m,block_tokens=16,slot_bytes=4096,slots=4",
            "--no-directory-mirror", "--directory-mirror-staleness-ms", "5",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode != 0
    assert "directory_mirror_staleness_ms must be an integer in 100..60000 (got 5)" in r.stderr
