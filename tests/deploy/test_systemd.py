"""deploy/systemd: the units pass `systemd-analyze verify` and carry the policy issue 9 asks.

verify runs against a scratch root holding the host's stock units, the kvdir
units and a stand-in kvdir executable at the path the units name, so the
check covers unit syntax, directive values and dependencies without needing
kvdir installed under /opt. A deliberately broken copy proves the check bites.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.tools import needs

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
STOCK = Path("/lib/systemd/system")
ANALYZE = shutil.which("systemd-analyze")

needs_analyze = needs(
    ANALYZE is not None and STOCK.is_dir(), "systemd-analyze or the stock units are missing"
)


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in (UNITS / unit).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(STOCK, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS.glob("*.service"):
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    exe = root / "opt/kvdir/venv/bin/kvdir"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return root


def _verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", f"--root={root}", *units],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_analyze
def test_units_verify_clean(tmp_path: Path) -> None:
    r = _verify(_root(tmp_path), "kvdir-directory@r1.service", "kvdir-agent.service")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    root = _root(tmp_path)
    unit = root / "etc/systemd/system/kvdir-agent.service"
    unit.write_text(unit.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOCK=lots"))
    r = _verify(root, "kvdir-agent.service")
    assert "LimitMEMLOCK" in r.stderr or "resource value" in r.stderr, r.stderr


@needs_analyze
def test_sysusers_entry_parses(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    assert sysusers is not None, "systemd-sysusers is missing (Debian's systemd ships it)"
    (tmp_path / "etc").mkdir()
    r = subprocess.run(
        [sysusers, "--dry-run", f"--root={tmp_path}", str(UNITS / "kvdir.sysusers.conf")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "Creating user 'kvdir'" in r.stdout + r.stderr


@pytest.mark.parametrize("unit", ["kvdir-directory@.service", "kvdir-agent.service"])
def test_units_carry_the_policy(unit: str) -> None:
    d = _directives(unit)
    assert d["Type"] == ["exec"]
    assert d["Restart"] == ["on-failure"]
    assert d["User"] == ["kvdir"] and "DynamicUser" not in d
    assert d["NoNewPrivileges"] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]
    assert d["KillSignal"] == ["SIGTERM"] and "TimeoutStopSec" in d
    (gate,) = d["ExecStartPost"]
    assert " ctl wait-ready " in gate and "--timeout" in gate and "--config /etc/kvdir/" in gate
    assert all(s.split()[0] == "/opt/kvdir/venv/bin/kvdir" for s in d["ExecStart"] + [gate])


def test_directory_unit_is_per_replica() -> None:
    d = _directives("kvdir-directory@.service")
    assert d["ExecStart"] == [
        "/opt/kvdir/venv/bin/kvdir directory serve --config /etc/kvdir/directory-%i.toml"
    ]
    assert d["StateDirectory"] == ["kvdir/directory-%i"]
    assert d["ReadWritePaths"] == ["/var/lib/kvdir/directory-%i"]


def test_agent_unit_can_pin_and_share_memory() -> None:
    d = _directives("kvdir-agent.service")
    assert d["LimitMEMLOCK"] == ["infinity"]
    assert d["ReadWritePaths"] == ["/dev/shm"]
    assert d["RuntimeDirectory"] == ["kvdir"]  # engine_socket = /run/kvdir/agent.sock
    assert "PrivateDevices" not in d  # rdma opens /dev/infiniband
