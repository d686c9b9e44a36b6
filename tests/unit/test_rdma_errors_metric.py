"""kvdir_agent_rdma_errors_total: the transport's counts, as every agent exports them.

The counting sites (error completions, deadline flushes, connect failures)
need a real RDMA device: tests/rdma/guest/test_verbs.py asserts them inside
the Soft-RoCE VM. Here: the counter object and its exposition.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvdir.agent.metrics import AgentMetrics
from kvdir.transfer.rdma_support import ERROR_KINDS, ERROR_STATUSES_MAX, RdmaErrors


def test_every_kind_is_exported_from_the_start() -> None:
    text = generate_latest(AgentMetrics().registry).decode()
    for kind in ERROR_KINDS:
        assert f'kvdir_agent_rdma_errors_total{{kind="{kind}",status=""}} 0.0' in text


def test_counts_by_kind_and_status() -> None:
    m = AgentMetrics()
    m.rdma_errors.add("completion", "IBV_WC_REM_ACCESS_ERR")
    m.rdma_errors.add("completion", "IBV_WC_REM_ACCESS_ERR")
    m.rdma_errors.add("deadline")
    text = generate_latest(m.registry).decode()
    assert (
        'kvdir_agent_rdma_errors_total{kind="completion",status="IBV_WC_REM_ACCESS_ERR"} 2.0'
        in text
    )
    assert 'kvdir_agent_rdma_errors_total{kind="deadline",status=""} 1.0' in text
    assert m.rdma_errors.total("completion") == 2 and m.rdma_errors.total("connect") == 0


def test_statuses_are_bounded_and_kinds_checked() -> None:
    e = RdmaErrors()
    for i in range(ERROR_STATUSES_MAX + 10):
        e.add("completion", f"status {i}")
    snap = e.snapshot()
    assert len(snap) == len(ERROR_KINDS) + ERROR_STATUSES_MAX + 1  # + the "other" bucket
    assert snap[("completion", "other")] == 10
    assert e.total("completion") == ERROR_STATUSES_MAX + 10
    with pytest.raises(ValueError, match="unknown rdma error kind"):
        e.add("typo")
