"""Fixtures of the agent tier: a real 3-replica directory and real agent processes.

One directory cluster serves the whole tier; the "trio" of agents is shared
too (a: tcp+shm, b: tcp only, c: tcp+shm), since tests keep to their own
chains. Tests that kill an agent launch their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient
from kvdir.local import LocalAgent, LocalCluster
from tests.agent.helpers import POOL_SPEC, launch_all, stop_all


@pytest.fixture(scope="session")
def agent_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(str(tmp_path_factory.mktemp("directory")), size=3)
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


@pytest.fixture
def directory(agent_cluster: LocalCluster) -> Iterator[DirectoryClient]:
    with agent_cluster.client(timeout_s=10) as c:
        yield c


@dataclass
class Trio:
    agents: dict[str, LocalAgent]
    engines: dict[str, EngineClient]

    @property
    def a(self) -> EngineClient:
        return self.engines["a"]

    @property
    def b(self) -> EngineClient:
        return self.engines["b"]

    @property
    def c(self) -> EngineClient:
        return self.engines["c"]


@pytest.fixture(scope="session")
def trio(agent_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    """Agents a (tcp,shm), b (tcp only: must read over tcp), c (tcp,shm: reads over shm)."""
    base = str(tmp_path_factory.mktemp("trio"))
    agents = {
        # A long lease: a starved heartbeat on a busy machine must not expire them.
        name: LocalAgent(
            name, base, agent_cluster.grpc_addresses, POOL_SPEC, transports=t, lease_ms=15_000
        )
        for name, t in (("a", "tcp,shm"), ("b", "tcp"), ("c", "tcp,shm"))
    }
    engines: dict[str, EngineClient] = {}
    try:
        launch_all(agents.values())
        engines = {n: EngineClient(a.engine_socket) for n, a in agents.items()}
        yield Trio(agents, engines)
    finally:
        for e in engines.values():
            e.close()
        stop_all(agents.values())
