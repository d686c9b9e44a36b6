"""`workers = N`: N gateway processes on one port (SO_REUSEPORT), run as `kvdir gateway`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvdir.local import free_port_run, free_ports, wait_for
from tests.gateway.helpers import MODEL, Backends, call, metric

pytestmark = pytest.mark.integration

REQUESTS_MAX = 200
"""Requests sent before giving up on seeing both workers answer (2^-199 by chance)."""


def _config(path: Path, backends: Backends, port: int, *extra: str) -> Path:
    lines = [f'listen = "127.0.0.1:{port}"', 'policy = "least-loaded"', 'log_format = "text"']
    lines += list(extra)
    for n in backends.names:
        lines += ["[[backends]]", f'url = "{backends.url(n)}"', f'node_id = "{n}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def _kvdir(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _up(port: int) -> bool:
    try:
        return call(port, "GET", "/health", timeout_s=1).status == 200
    except OSError:
        return False


@contextmanager
def _daemon(cfg: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdir.cli", "gateway", "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _frozen(log: Path) -> list[int]:
    """The object counts of the start-up freeze records (kvdir/core/gc_freeze.py) in the log."""
    return [int(n) for n in re.findall(r"kvdir\.gc froze (\d+) start-up objects", log.read_text())]


def _served(port: int) -> float:
    return metric(port, "kvdir_gateway_requests_total", {"endpoint": "completions"})


@pytest.mark.timeout(120)
def test_two_workers_serve_one_port_and_stop_on_sigterm(backends: Backends, tmp_path: Path) -> None:
    base = free_port_run(3)
    port = base + 2  # workers 0 and 1 own base and base + 1
    cfg = _config(tmp_path / "gw.toml", backends, port, "workers = 2", f"worker_port_base = {base}")
    with _daemon(cfg, tmp_path / "gw.log") as proc:
        wait_for(lambda: _up(port) and _up(base) and _up(base + 1), 60, "both workers")
        for w in (0, 1):  # each worker's own port says which worker it is
            assert metric(base + w, "kvdir_gateway_worker", {"worker": str(w)}) == 1
        # Each worker froze its start-up objects before it said it was ready.
        # (aiohttp, grpc, protobuf and the gateway: tens of thousands of objects each)
        frozen = _frozen(tmp_path / "gw.log")
        assert len(frozen) == 2 and min(frozen) > 10_000, (tmp_path / "gw.log").read_text()
        sent = 0
        while sent < REQUESTS_MAX and not (_served(base) and _served(base + 1)):
            r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [sent]})
            assert r.status == 200, r.body
            sent += 1
        counts = [_served(base), _served(base + 1)]
        assert all(counts) and sum(counts) == sent, (counts, sent)
        assert metric(base, "process_cpu_seconds_total") > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, (tmp_path / "gw.log").read_text()
    for p in (port, base, base + 1):
        assert not _up(p)  # the workers are gone with the parent


@pytest.mark.timeout(60)
def test_bad_workers_values_are_refused_with_one_line(tmp_path: Path) -> None:
    b = "\n[[backends]]\nurl = 'http://127.0.0.1:1'\nnode_id = 'a'\n"
    cases = {
        "zero": ('listen = "127.0.0.1:8080"\nworkers = 0' + b, "workers must be an integer"),
        "text": ('listen = "127.0.0.1:8080"\nworkers = "2"' + b, "workers must be an integer"),
        "many": ('listen = "127.0.0.1:8080"\nworkers = 1000' + b, "from 1 to 64"),
        "port0": ('listen = "127.0.0.1:0"\nworkers = 2' + b, "fixed listen port"),
        "ports": ('listen = "127.0.0.1:1"\nworkers = 2\nworker_port_base = 65535' + b, "room"),
    }
    for name, (text, why) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        r = _kvdir("gateway", "--config", str(path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (name, r.stderr)
        assert lines[0].startswith("kvdir: error:") and why in lines[0], (name, lines)


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_start_stops_the_gateway_with_one_line(
    backends: Backends, tmp_path: Path
) -> None:
    bad = _config(
        tmp_path / "tok.toml",
        backends,
        free_ports(1)[0],
        "workers = 2",
        '[[models]]\nname = "m"\ntokenizer = "/nonexistent/tokenizer.json"',
    )
    r = _kvdir("gateway", "--config", str(bad))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "could not start" in lines[0] and "tokenizer" in lines[0], lines

    with socket.socket() as taken:  # a listener without SO_REUSEPORT holds the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = _config(tmp_path / "busy.toml", backends, taken.getsockname()[1], "workers = 2")
        r = _kvdir("gateway", "--config", str(cfg))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("kvdir: error: gateway: worker"), r.stderr
    assert "could not start" in last and "address already in use" in last.lower(), last
