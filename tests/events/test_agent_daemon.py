"""`kvdir agent serve --engine ...`: the daemon ingests vLLM's real events."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvdir.agent.events.hashes import keys
from kvdir.core.client import DirectoryClient, namespace
from kvdir.local import LocalAgent, LocalCluster, wait_for
from tests.agent.helpers import POOL_SPEC, scrape, stop_all
from tests.events.helpers import (
    VLLM_VERSIONS,
    WAIT_S,
    VllmEngine,
    published_hashes,
    tokens,
    vllm_python,
    wait_prefix,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_agent_daemon_ingests_engine_events(
    events_cluster: LocalCluster, directory: DirectoryClient, tmp_path: Path
) -> None:
    py = vllm_python(VLLM_VERSIONS[0])
    pub, rep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    agent = LocalAgent("daemon-ev", str(tmp_path), events_cluster.grpc_addresses, POOL_SPEC)
    spec = f"name=vllm,endpoint={pub},replay_endpoint={rep},model=daemon-ev,block_tokens=16"
    spec += ",hash_algo=sha256"
    eng = VllmEngine(py, pub, rep, str(tmp_path / "vllm.log"))
    try:
        with open(agent.log_path, "ab") as log:
            agent.proc = subprocess.Popen(
                [*agent.command(), "--engine", spec],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        agent.wait_ready(WAIT_S)
        label = '{engine="vllm",rank="0"}'

        def seen() -> int:
            return int(
                scrape(agent.metrics_address).get(f"kvdir_agent_events_messages_total{label}", 0)
            )

        sent = [0]

        def through() -> bool:
            sent[0] += 1
            eng.store(f"w{sent[0]}", tokens(500 + sent[0], 1))
            return seen() > 0

        wait_for(through, WAIT_S, "the agent to receive the engine's events", 0.1)
        chain = keys(published_hashes(eng.store("d1", tokens(600, 5))))
        ns = namespace("daemon-ev", 16)
        wait_prefix(directory, ns, chain, "daemon-ev/vllm/dp0", 5)
        m = scrape(agent.metrics_address)
        assert m[f"kvdir_agent_events_decode_errors_total{label}"] == 0
        assert m['kvdir_agent_events_hash_checks_total{engine="vllm",result="passed"}'] >= 1
        lookup = directory.lookup(ns, chain)
        match = next(x for x in lookup.matches if x.node_id == "daemon-ev/vllm/dp0")
        assert list(match.transports) == [] and match.host == "127.0.0.1"
    finally:
        eng.close()
        stop_all([agent])
