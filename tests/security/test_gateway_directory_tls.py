"""The gateway asks a mutual-TLS directory for prefix holders.

Real replica processes over mTLS (tests/security/conftest.py), echo backends
and the gateway in-process. With the directory_* keys its lookups succeed;
without them the directory refuses the plaintext channel and the gateway
degrades to least-loaded and says so in its metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvdir.gateway.config import from_dict
from kvdir.gateway.server import BackgroundGateway
from kvdir.local import LocalCluster
from tests.gateway.helpers import MODEL, Backends, backend_cfg, call, metric
from tests.security.conftest import Pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def backends() -> Iterator[Backends]:
    b = Backends(["b1", "b2"]).start()
    try:
        yield b
    finally:
        b.stop()


def _decisions(cluster: LocalCluster, b: Backends, **directory_keys: str) -> dict[str, float]:
    raw: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "directory": cluster.grpc_addresses,
        "policy": "affinity",
        "lookup_timeout_ms": 3000,
        "health_interval_s": 0.2,
        "models": [{"name": MODEL, "block_tokens": 16}],  # token-id prompts only
        "backends": [backend_cfg(b, n, transports=["tcp"]) for n in b.names],
        **directory_keys,
    }
    gw = BackgroundGateway(from_dict(raw))
    gw.start()
    try:
        port = gw.gateway.port
        for i in range(3):
            prompt = [(i * 7 + t) % 1000 for t in range(64)]
            r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt})
            assert r.status == 200, r.body
        return {
            "up": metric(port, "kvdir_gateway_directory_up"),
            "degraded": metric(port, "kvdir_gateway_degraded_decisions_total"),
            "affinity": metric(port, "kvdir_gateway_decisions_total", {"policy": "affinity"}),
        }
    finally:
        gw.stop()


def test_gateway_looks_up_through_mtls(
    secure_cluster: LocalCluster, pki: Pki, backends: Backends
) -> None:
    leaf = pki.leaves["node-b"]  # any identity may read
    got = _decisions(
        secure_cluster,
        backends,
        directory_ca=leaf.ca,
        directory_cert=leaf.cert,
        directory_key=leaf.key,
    )
    assert got == {"up": 1, "degraded": 0, "affinity": 3}


def test_gateway_without_directory_credentials_degrades(
    secure_cluster: LocalCluster, backends: Backends
) -> None:
    got = _decisions(secure_cluster, backends)
    assert got["up"] == 0 and got["degraded"] == 3 and got["affinity"] == 0


def test_a_certificate_without_its_ca_is_a_config_error(pki: Pki) -> None:
    from kvdir.core.config import ConfigError

    with pytest.raises(ConfigError, match="directory_"):
        from_dict(
            {
                "backends": [{"url": "http://127.0.0.1:1", "node_id": "x"}],
                "directory_cert": pki.leaves["node-b"].cert,
                "directory_key": pki.leaves["node-b"].key,
            }
        )
