"""Without pyverbs, 'rdma' fails clearly and everything else keeps working."""

from __future__ import annotations

import sys

import pytest

from kvdir.agent.config import from_dict
from kvdir.transfer.engine import TransferEngine
from kvdir.transfer.rdma_support import capabilities


@pytest.fixture
def no_pyverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    for name in [m for m in sys.modules if m.startswith("pyverbs.") or m == "kvdir.transfer.rdma"]:
        monkeypatch.delitem(sys.modules, name)


def test_engine_with_rdma_names_pyverbs(no_pyverbs: None) -> None:
    with pytest.raises(ValueError, match=r"rdma backend needs pyverbs.*python3-pyverbs"):
        TransferEngine(["rdma"])


def test_engine_without_rdma_never_imports_pyverbs(no_pyverbs: None) -> None:
    TransferEngine([]).close()
    assert "kvdir.transfer.rdma" not in sys.modules


def test_capability_report_says_why(no_pyverbs: None) -> None:
    caps = capabilities()
    assert caps["pyverbs"] is False and caps["devices"] == []
    assert "python3-pyverbs" in caps["reason"]


def test_config_accepts_rdma_and_its_options() -> None:
    cfg = from_dict(
        {
            "node_id": "n",
            "host": "127.0.0.1",
            "directory": ["127.0.0.1:1"],
            "listen": "127.0.0.1:2",
            "engine_socket": "/tmp/x.sock",
            "transports": "rdma,tcp",
            "rdma_device": "mlx5_0",
            "rdma_gid_index": 3,
            "pools": [{"model": "m", "block_tokens": 16, "slot_bytes": 4096, "slots": 4}],
        }
    )
    assert cfg.transports == ("rdma", "tcp") and cfg.rdma_gid_index == 3
