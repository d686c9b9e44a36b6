"""The bench's cluster: a 3-replica directory, three agents, four real vLLM engines.

    a  engine + agent (tcp, shm)   computes and saves every prefix (the holder)
    n  engine, no connector        recompute and plain-prefill baselines
    b  engine + agent (tcp)        pulls a's prefixes over TCP
    c  engine + agent (tcp, shm)   pulls a's prefixes over shared memory

All on 127.0.0.1; the engines start in parallel and are reused for every
prompt length (each measurement uses fresh prompts, so no engine's own
prefix cache can answer for it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from bench.vllm.engine import BenchEngine
from bench.vllm.model import Shape, pool_spec, write_model
from kvdir.local import LocalAgent, LocalCluster
from tests.vllm.engines import connector_config

AGENTS = {"a": "tcp,shm", "b": "tcp", "c": "tcp,shm"}
ENGINES = ("a", "n", "b", "c")
LEASE_MS = 30_000
LOAD_TIMEOUT_MS = 60_000
"""A loaded 2-core host moves 64 MiB slowly; the default 5 s would fall back to recompute."""
LOOKUP_TIMEOUT_MS = 3000
"""The default 300 ms lapsed on a host at load 20-30 (the 4k tcp row of the first run)."""


@dataclass
class Nodes:
    cluster: LocalCluster
    agents: dict[str, LocalAgent]
    engines: dict[str, BenchEngine]


def _engines(
    base: str, model_dir: str, shape: Shape, max_len: int, agents: dict[str, LocalAgent]
) -> dict[str, BenchEngine]:
    engines: dict[str, BenchEngine] = {}
    try:
        for name in ENGINES:
            a = agents.get(name)
            ktc = (
                connector_config(
                    a.engine_socket,
                    load_timeout_ms=LOAD_TIMEOUT_MS,
                    lookup_timeout_ms=LOOKUP_TIMEOUT_MS,
                )
                if a
                else None
            )
            engines[name] = BenchEngine(
                name,
                model_dir,
                os.path.join(base, f"{name}-engine.log"),
                ktc,
                model_name=shape.name,
                max_model_len=max_len,
            )
            engines[name].launch()
        for e in engines.values():
            e.wait_ready()
    except BaseException:
        for e in engines.values():
            e.stop()
        raise
    return engines


@contextlib.contextmanager
def nodes(base: str, shape: Shape, max_len: int, pool_slots: int) -> Iterator[Nodes]:
    model_dir = write_model(shape, os.path.join(base, "model"), max_len)
    cluster = LocalCluster(os.path.join(base, "directory"), size=3)
    agents: dict[str, LocalAgent] = {}
    engines: dict[str, BenchEngine] = {}
    try:
        cluster.start(timeout_s=60)
        for name, transports in AGENTS.items():
            agents[name] = LocalAgent(
                name,
                base,
                cluster.grpc_addresses,
                pool_spec(shape, pool_slots),
                transports,
                lease_ms=LEASE_MS,
            )
            agents[name].launch(timeout_s=60)
        engines = _engines(base, model_dir, shape, max_len, agents)
        yield Nodes(cluster, agents, engines)
    finally:
        for e in engines.values():
            e.stop()
        for a in agents.values():
            a.stop()
        cluster.stop()
