"""`kvdir demo`: the main job on an embedded default.

Starts a real 3-replica directory (three `kvdir directory serve` processes on
127.0.0.1 with their own journals), registers two holder nodes, publishes the
prefix-chained block hashes of real token sequences through a follower, looks
them up on every replica (local and linearizable reads), shows
`kvdir ctl status`, and stops everything. Each step checks its result, so the
demo exits non-zero if the system misbehaves.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

from directory.client import DirectoryClient, namespace, records
from directory.hashing import block_chain
from kvdir.local import LocalCluster
from proto.kvdir.v1 import directory_pb2 as pb


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a local 3-replica directory and a real workload")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--dir", help="where replicas keep their data (default: a temp dir)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


class DemoFailed(RuntimeError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise DemoFailed(what)


def _publish_chain(
    c: DirectoryClient, node: str, inc: int, ns: pb.Namespace, chain: list[bytes], base_addr: int
) -> None:
    for i in range(0, len(chain), 256):
        part = chain[i : i + 256]
        c.publish(
            node,
            inc,
            ns,
            pb.TIER_GPU,
            part,
            [base_addr + (i + k) * 65536 for k in range(len(part))],
            [65536] * len(part),
            [0x1234] * len(part),
            [1] * len(part),
        )


def workload(cluster: LocalCluster, seed: int) -> None:
    rng = random.Random(seed)
    ns = namespace("meta-llama/Llama-3.1-8B", 16, "bf16", "vllm-paged")
    leader = cluster.wait_leader()
    follower = next(r for r in cluster.replicas if r is not leader)
    step(f"leader is {leader.replica_id}; writing through follower {follower.replica_id}")
    doc = [rng.randrange(128_000) for _ in range(4000)]
    turn2 = [*doc, *(rng.randrange(128_000) for _ in range(1000))]
    chain_a = block_chain(turn2, 16)
    chain_b = block_chain(doc[:1600], 16)
    with DirectoryClient([follower.grpc_address], timeout_s=10) as c:
        inc = time.time_ns()
        for node in ("node-a", "node-b"):
            c.register_node(
                node,
                "127.0.0.1",
                inc,
                f"127.0.0.1:{9000 + len(node)}",
                ["tcp", "shm"],
                lease_ms=30_000,
            )
        t0 = time.perf_counter()
        _publish_chain(c, "node-a", inc, ns, chain_a, 0x7F00_0000_0000)
        _publish_chain(c, "node-b", inc, ns, chain_b, 0x7E00_0000_0000)
        ms = (time.perf_counter() - t0) * 1e3
        step(f"published {len(chain_a)} + {len(chain_b)} blocks in {ms:.1f} ms")
    query = block_chain([*doc, *(rng.randrange(128_000) for _ in range(512))], 16)
    step(f"looking up a {len(query)}-block chain (turn 2 of the conversation) on each replica")
    with cluster.client() as c:
        for r in cluster.replicas:
            resp = c.lookup(ns, query, address=r.grpc_address, linearizable=(r is follower))
            got = [(m.node_id, m.prefix_blocks) for m in resp.matches]
            kind = "linearizable" if resp.read.linearizable else "local"
            print(f"    {r.replica_id}: {kind} read at index {resp.read.applied_index}: {got}")
            if kind == "local" and not got:
                continue  # a follower may not have applied the last publish yet
            check(got == [("node-a", 250), ("node-b", 100)], f"unexpected lookup result {got}")
        resp = c.lookup(ns, query, exclude_node="node-a", linearizable=True)
        check([m.node_id for m in resp.matches] == ["node-b"], "exclude_node did not apply")
        m = resp.matches[0]
        rec = records(m)
        print(
            f"    excluding node-a: node-b holds {m.prefix_blocks} blocks; block 0 at "
            f"{rec.addresses[0]:#x} rkey {rec.rkeys[0]:#x} gen {rec.generations[0]}"
        )


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvdir-demo-") as tmp:
        base = args.dir or tmp
        step(f"starting a {args.replicas}-replica directory under {base}")
        with LocalCluster(base, size=args.replicas) as cluster:
            cluster.start()
            for r in cluster.replicas:
                print(
                    f"    {r.replica_id}: raft {r.raft_address}  grpc {r.grpc_address}  "
                    f"metrics http://{r.metrics_address}/metrics"
                )
            workload(cluster, args.seed)
            step("kvdir ctl status")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvdir.cli",
                    "ctl",
                    "status",
                    "--addr",
                    ",".join(cluster.grpc_addresses),
                ],
                check=True,
            )
            step("stopping the cluster")
    step("demo finished: all checks passed")
    return 0
