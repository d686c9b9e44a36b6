"""Routing fed by a real directory: two nodes publish prefixes, the policy reads them."""

from __future__ import annotations

import random

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.routing import Candidate, CostModel, Policy, Router, Rule
from kvdir.routing.directory_source import DirectorySource
from tests.integration.helpers import LONG_LEASE_MS, chain, ns, publish

pytestmark = pytest.mark.integration


@pytest.mark.timeout(90)
def test_directory_backed_prompts_drive_affinity_and_pool(client: DirectoryClient) -> None:
    space = ns("routing-test", block_tokens=16)
    for i, (node, host) in enumerate((("route-a", "10.0.0.1"), ("route-b", "10.0.0.2"))):
        client.register_node(
            node, host, 1, f"{host}:{9100 + i}", ["rdma", "tcp"], lease_ms=LONG_LEASE_MS
        )
    long_chain = chain(250, salt=61)  # 4,000 tokens
    other_chain = chain(40, salt=62)
    publish(client, "route-a", 1, space, long_chain)
    publish(client, "route-b", 1, space, long_chain[:100])
    publish(client, "route-b", 1, space, other_chain)

    source = DirectorySource(client, space, linearizable=True)
    long_p, other_p, cold_p = source.prompts([long_chain, other_chain, chain(8, salt=63)])
    assert long_p.local_blocks("route-a") == 250 and long_p.local_blocks("route-b") == 100
    assert other_p.local_blocks("route-b") == 40 and other_p.local_blocks("route-a") == 0
    assert cold_p.holders == {}
    assert long_p.holders["route-a"].transports == frozenset({"rdma", "tcp"})

    cost = CostModel(block_tokens=16)
    nodes = [
        Candidate("route-a", 0, "10.0.0.1", frozenset({"rdma", "tcp"})),
        Candidate("route-b", 0, "10.0.0.2", frozenset({"rdma", "tcp"})),
        Candidate("route-c", 0, "10.0.0.3", frozenset({"rdma", "tcp"})),
    ]
    affinity = Router(Policy.AFFINITY, cost, random.Random(0))
    assert affinity.decide(nodes, long_p).node_id == "route-a"
    assert affinity.decide(nodes, other_p).node_id == "route-b"
    assert affinity.decide(nodes, cold_p).rule is Rule.NO_HIT

    busy_a = [Candidate(c.node_id, 3 if c.node_id == "route-a" else 0, c.host, c.transports)
              for c in nodes]  # fmt: skip
    d = Router(Policy.AFFINITY_POOL, cost, random.Random(0)).decide(busy_a, long_p)
    assert (d.node_id, d.rule, d.pull_from, d.transport) == (
        "route-b",
        Rule.POOL,
        "route-a",
        "rdma",
    )
    assert (d.local_blocks, d.pulled_blocks) == (100, 150)
