"""Off loopback the Raft port needs a password, and the password must be a secret.

pysyncobj calls `pickle.loads` on every frame that reaches the Raft port; only
the password's encryption keeps a stranger's frame from running code in the
replica. A replica whose Raft address (or bind address) another machine could
reach refuses to start without `[auth] raft_password_file`, and any replica
refuses a password shorter than `RAFT_PASSWORD_CHARS_MIN`, each with one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdir.core.config import ConfigError
from kvdir.core.security import (
    RAFT_PASSWORD_CHARS_MIN,
    SecurityConfigError,
    is_loopback,
    read_raft_password,
)
from kvdir.directory.config import from_dict

SERVE_TIMEOUT_S = 60


def _cfg(raft: str, bind: str = "", password_file: str = "") -> dict[str, object]:
    raw: dict[str, object] = {
        "replica_id": "r1",
        "raft_address": raft,
        "grpc_address": "127.0.0.1:2",
        "data_dir": "/tmp/x",
        "raft_bind_address": bind,
    }
    if password_file:
        raw["auth"] = {"raft_password_file": password_file}
    return raw


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7001", True),
        ("127.5.6.7:7001", True),
        ("localhost:7001", True),
        ("[::1]:7001", True),
        ("::1", True),
        ("10.0.0.1:7001", False),
        ("0.0.0.0:7001", False),
        ("[::]:7001", False),
        ("kvdir-directory-0.kvdir:7001", False),
        ("127.0.0.1.example.com:7001", False),
    ],
)
def test_which_addresses_are_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


@pytest.mark.parametrize(
    ("raft", "bind"),
    [("10.0.0.1:7001", ""), ("127.0.0.1:7001", "0.0.0.0:7001"), ("db-0.kvdir:7001", "")],
)
def test_a_reachable_raft_port_without_a_password_is_refused(raft: str, bind: str) -> None:
    with pytest.raises(ConfigError, match="is not loopback: set \\[auth\\] raft_password_file"):
        from_dict(_cfg(raft, bind))
    assert from_dict(_cfg(raft, bind, "/etc/kvdir/raft.password")).auth.raft_password_file


def test_a_loopback_raft_port_may_go_without_a_password() -> None:
    assert from_dict(_cfg("127.0.0.1:7001", "127.0.0.1:7001")).auth.raft_password_file == ""


def test_a_short_password_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "raft.password"
    path.write_text("x" * (RAFT_PASSWORD_CHARS_MIN - 1) + "\n")
    with pytest.raises(SecurityConfigError, match=f"fewer than {RAFT_PASSWORD_CHARS_MIN}"):
        read_raft_password(str(path))
    path.write_text("x" * RAFT_PASSWORD_CHARS_MIN + "\n")
    assert read_raft_password(str(path)) == "x" * RAFT_PASSWORD_CHARS_MIN


def _serve(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdir.cli",
            "directory",
            "serve",
            "--replica-id",
            "r1",
            "--grpc",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "data"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=SERVE_TIMEOUT_S,
        check=False,
    )


def test_serve_refuses_each_with_one_line(tmp_path: Path) -> None:
    """The real CLI: an exposed Raft port without a password, then a short password."""
    r = _serve(tmp_path, "--raft", "10.255.0.1:7001")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "kvdir: error: raft address 10.255.0.1:7001 is not loopback: set [auth] "
        "raft_password_file (--raft-password-file), or anyone who reaches the Raft port "
        "can run code in this replica (docs/security.md)"
    ]
    short = tmp_path / "short.password"
    short.write_text("hunter2\n")
    r = _serve(tmp_path, "--raft", "127.0.0.1:0", "--raft-password-file", str(short))
    assert r.returncode != 0
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert f"holds 7 characters, fewer than {RAFT_PASSWORD_CHARS_MIN}" in line, r.stderr
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())
