"""Every metric the alert rules and the dashboard name is exported by a running daemon.

A real 3-replica directory and two real agents on 127.0.0.1 take some
traffic (register, publish, lookup, a fetch over tcp), then each /metrics
page is scraped. Names are matched against the exposed sample names, so a
histogram must be used as _bucket/_sum/_count and a counter as _total, as
PromQL requires. Also: `kvdir ctl wait-ready`, the systemd units' health gate.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdir.agent.engine.client import EngineClient
from kvdir.local import LocalAgent, LocalCluster, wait_for
from tests.agent.helpers import NS, POOL_SPEC, WAIT_S, chain_of, launch_all, stop_all, store_chain
from tests.deploy.names import SYNTHETIC, dashboard_exprs, metric_names, other_series, rule_exprs

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus/rules.yml"
DASHBOARD = DEPLOY / "grafana/kvdir.json"


def sample_names(metrics_address: str) -> set[str]:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@dataclass
class Deployment:
    cluster: LocalCluster
    agents: dict[str, LocalAgent]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    cluster = LocalCluster(str(tmp_path_factory.mktemp("directory")), size=3)
    agents: dict[str, LocalAgent] = {}
    try:
        cluster.start(timeout_s=60)
        base = str(tmp_path_factory.mktemp("agents"))
        agents = {
            n: LocalAgent(n, base, cluster.grpc_addresses, POOL_SPEC, transports="tcp")
            for n in ("holder", "reader")
        }
        launch_all(agents.values())
        yield Deployment(cluster, agents)
    finally:
        stop_all(agents.values())
        cluster.stop()


def _traffic(d: Deployment) -> None:
    holder = EngineClient(d.agents["holder"].engine_socket)
    reader = EngineClient(d.agents["reader"].engine_socket)
    try:
        chain = chain_of(900, 4)
        store_chain(holder, chain, seed=900)

        def fetched_all() -> bool:
            dst = reader.allocate(NS, 4).slots
            try:
                return reader.fetch(NS, chain, dst).valid_blocks == 4
            finally:
                reader.free(NS, dst)

        wait_for(fetched_all, WAIT_S, "the reader to fetch the holder's chain", 0.1)
    finally:
        holder.close()
        reader.close()


def test_rules_and_dashboard_name_only_exported_metrics(deployment: Deployment) -> None:
    _traffic(deployment)
    exported: dict[str, set[str]] = {}
    for r in deployment.cluster.replicas:
        exported.setdefault("directory", set()).update(sample_names(r.metrics_address))
    for a in deployment.agents.values():
        exported.setdefault("agent", set()).update(sample_names(a.metrics_address))
    everything = exported["directory"] | exported["agent"]

    used: dict[str, set[str]] = {}
    exprs = [(RULES.name, e) for e in rule_exprs(RULES)]
    exprs += [(DASHBOARD.name, e) for e in dashboard_exprs(DASHBOARD)]
    for source, expr in exprs:
        assert other_series(expr) <= SYNTHETIC, f"{source}: non-kvdir series in {expr!r}"
        for name in metric_names(expr):
            used.setdefault(name, set()).add(source)

    assert len(used) >= 20, sorted(used)
    for family in ("directory", "agent"):
        assert any(n.startswith(f"kvdir_{family}_") for n in used)
    missing = {n: sorted(src) for n, src in used.items() if n not in everything}
    assert not missing, f"named but not exported by a running daemon: {missing}"


def test_wait_ready_gate(deployment: Deployment) -> None:
    """The units' ExecStartPost: ready replicas and agents pass, a dead address fails in time."""
    cli = [sys.executable, "-m", "kvdir.cli", "ctl", "wait-ready"]
    addrs = ",".join(deployment.cluster.grpc_addresses)
    r = subprocess.run(
        [*cli, "--addr", addrs, "--timeout", "20"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    agent = deployment.agents["holder"]
    r = subprocess.run(
        [*cli, "--agent", "--addr", agent.listen, "--timeout", "20"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cfg = Path(agent.pool_dir) / "probe.toml"
    cfg.write_text(f'grpc_address = "{deployment.cluster.grpc_addresses[0]}"\n')
    r = subprocess.run(
        [*cli, "--config", str(cfg), "--timeout", "20"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    from kvdir.local import free_ports

    (dead,) = free_ports(1)
    r = subprocess.run(
        [*cli, "--addr", f"127.0.0.1:{dead}", "--timeout", "1.5", "--interval", "0.2"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert "not ready after" in r.stderr and "UNAVAILABLE" in r.stderr
