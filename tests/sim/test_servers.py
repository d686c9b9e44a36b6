"""Seeded simulation of the gRPC servicer over N in-process replicas (`consensus.memory`).

One seed drives three `DirectoryService`s, each over its own `MemoryReplica`
of one `MemoryCluster`, with agents' writes and lookups sent to random
replicas while Raft's side misbehaves on schedule: leader changes, no
leader, a follower held back and released, outcomes reported as unknown
(committed or not) or as not applied. Checked at every step: a request
either succeeds or fails with the gRPC status the error contract names, and
the indexes a replica reports never go backwards; at the end, once every
replica is released, all tables have one digest, the digest of the log
replayed into a fresh table. A failure names its seed (`-k seed_<n>`).
"""

from __future__ import annotations

import os
import random

import grpc
import pytest

from kvdir.directory.consensus.memory import MemoryCluster
from kvdir.directory.consensus.port import Outcome
from kvdir.directory.table import Table
from kvdir.v1 import directory_pb2 as pb
from tests.unit.test_server_port import (
    RAFT,
    Aborted,
    Clock,
    FakeContext,
    call,
    chain,
    holders,
    service,
)

SEEDS = int(os.environ.get("KVDIR_SIM_SEEDS", "20"))
STEPS = 300
ADDRS = [*RAFT, "127.0.0.1:7003"]
WRITE_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED}


def _publish_req(rng: random.Random, node: str) -> pb.PublishRequest:
    start, n = rng.randrange(8), rng.randrange(1, 6)
    hashes = chain(start + n)[start:]
    return pb.PublishRequest(
        node_id=node,
        incarnation=1,
        namespace=pb.Namespace(model="sim", block_tokens=16),
        tier=pb.TIER_GPU,
        block_hashes=hashes,
        addresses=[0x1000 + start + i for i in range(n)],
        lengths=[4096] * n,
        rkeys=[7] * n,
        generations=[rng.randrange(1, 4)] * n,
    )


def _chaos(rng: random.Random, cluster: MemoryCluster) -> None:
    roll = rng.random()
    if roll < 0.05:
        cluster.elect(rng.choice([*ADDRS, None]))
    elif roll < 0.08:
        cluster.hold(rng.choice(ADDRS))
    elif roll < 0.14:
        cluster.release(rng.choice(ADDRS))
    elif roll < 0.18:
        outcome = rng.choice([Outcome.UNKNOWN, Outcome.NOT_APPLIED])
        cluster.fail_next(
            outcome, "simulated", applied=outcome is Outcome.UNKNOWN and rng.random() < 0.5
        )


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed_{s}")
def test_servicers_agree_through_leader_changes(seed: int) -> None:
    rng, clock = random.Random(seed), Clock()
    cluster = MemoryCluster(ADDRS)
    services = [service(cluster, clock, i) for i in range(len(RAFT))]
    last_index = [0] * len(services)
    for step in range(STEPS):
        _chaos(rng, cluster)
        clock.ms += rng.randrange(50)
        i = rng.randrange(len(services))
        svc, node = services[i], f"n{rng.randrange(3)}"
        try:
            if rng.random() < 0.2:
                req = pb.RegisterNodeRequest(node_id=node, host="h", incarnation=1, lease_ms=60_000)
                call(svc.RegisterNode, req, FakeContext())
            elif rng.random() < 0.6:
                call(svc.Publish, _publish_req(rng, node))
            else:
                holders(svc, chain(12), linearizable=rng.random() < 0.3)
        except Aborted as e:
            assert e.code in WRITE_FAILURES | {grpc.StatusCode.INVALID_ARGUMENT}, (seed, step, e)
        applied = cluster[RAFT[i]].status().applied_index
        assert applied >= last_index[i], f"seed {seed} step {step}: index went back"
        last_index[i] = applied
    for addr in ADDRS:
        cluster.release(addr)
    replay = Table()
    for _, cmd in cluster.log:
        replay.apply(cmd)
    digests = {cluster[a].read(lambda t: t.digest()) for a in ADDRS}
    assert digests == {replay.digest()}, f"seed {seed}: replicas disagree"
