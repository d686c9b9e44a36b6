"""Shared fixtures. Unit and simulation tiers may not touch the network."""

from __future__ import annotations

import gc
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir import harness
from kvdir.local import LocalCluster

_UNIT_TIERS = ("tests/unit", "tests/sim")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERMed run stops as a ^C'd one does: pytest tears every fixture down, so
    the replicas, agents, engines, VMs and containers they started are stopped.

    A run started in the background by a script (scripts/run-tests.sh) begins with
    SIGINT ignored, and every process it starts would inherit that (a test stopping
    one with SIGINT would wait forever): ^C is given back its usual meaning here.
    """
    harness.interrupt_on_sigterm()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The backstop: whatever a test or fixture left running below this process ends
    with the run (kvdir/harness.py), never outlives it."""
    harness.end_descendants()


@pytest.fixture(autouse=True)
def _no_network_in_unit_tiers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unit and simulation tests stay pure: opening a socket there is a bug."""
    path = str(request.node.path)
    if any(t in path for t in _UNIT_TIERS):

        def refuse(*_a: object, **_k: object) -> None:
            raise RuntimeError("unit/sim tests must not open sockets")

        monkeypatch.setattr(socket.socket, "connect", refuse)
        monkeypatch.setattr(socket.socket, "bind", refuse)


@pytest.fixture(scope="module", autouse=True)
def _leaks_named_by_module() -> Iterator[None]:
    """A socket a module's tests left open (one only a collection frees) is
    found at the end of that module, so the failure names the module. Left to
    the interpreter's last collection it fails the whole run and names nothing."""
    yield
    gc.collect()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A started 3-replica directory of real processes on 127.0.0.1."""
    c = LocalCluster(str(tmp_path), size=3)
    try:
        c.start(timeout_s=30)
        yield c
    finally:
        c.stop()
