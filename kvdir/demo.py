"""`kvdir demo`: the main job on an embedded default.

Starts a real 3-replica directory (three `kvdir directory serve` processes on
127.0.0.1 with their own journals) and exercises it in two parts:

1. Directory: registers two holder nodes, publishes the prefix-chained block
   hashes of a conversation through a follower, looks them up on every replica
   (local and linearizable reads).
2. Agents: starts three `kvdir agent serve` processes, each with its own
   shared-memory KV pool. The "engine" on node A prefills turn 1 of a
   conversation (its KV blocks are real bytes written into A's slots) and
   announces them; turn 2 lands on node B (TCP only) and node C (shared
   memory), which pull the prefix from A and verify every byte.

Then it shows `kvdir ctl status` and `kvdir ctl nodes` and stops everything.
Each step checks its result, so the demo exits non-zero if anything is wrong.
KV blocks are scaled down (64 KiB per 16-token block instead of the 2 MiB of a
Llama-3-8B block) so the demo runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import xxhash

from agent.engine_client import EngineClient
from directory.client import DirectoryClient, namespace, records
from directory.hashing import block_chain
from kvdir.local import LocalAgent, LocalCluster, wait_for
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


DEMO_BLOCK_BYTES = 64 * 1024
DEMO_POOL_SLOTS = 512


def _kv_bytes(block_hash: bytes) -> bytes:
    """Deterministic stand-in for a block's KV (what a real prefill would write)."""
    return xxhash.xxh3_128_digest(block_hash) * (DEMO_BLOCK_BYTES // 16)


def agents_part(cluster: LocalCluster, base: str, seed: int) -> None:
    rng = random.Random(seed + 1)
    spec = (
        f"model=meta-llama/Llama-3.1-8B,dtype=bf16,block_tokens=16,layout=vllm-paged,"
        f"slot_bytes={DEMO_BLOCK_BYTES},slots={DEMO_POOL_SLOTS}"
    )
    ns = namespace("meta-llama/Llama-3.1-8B", 16, "bf16", "vllm-paged")
    agents = [
        LocalAgent(name, base, cluster.grpc_addresses, spec, transports=t, lease_ms=5000)
        for name, t in (("node-1", "tcp,shm"), ("node-2", "tcp"), ("node-3", "tcp,shm"))
    ]
    engines: list[EngineClient] = []
    try:
        for a in agents:
            a.launch()
        step("agents node-1 (tcp, shm), node-2 (tcp only), node-3 (tcp, shm) are up")
        engines = [EngineClient(a.engine_socket) for a in agents]
        ea = engines[0]
        turn1 = [rng.randrange(128_000) for _ in range(4096)]
        chain = block_chain(turn1, 16)
        alloc = ea.allocate(ns, len(chain))
        for h, slot in zip(chain, alloc.slots, strict=True):
            ea.slot_view(ns, slot)[:] = _kv_bytes(h)
        t0 = time.perf_counter()
        ea.stored(ns, chain, alloc.slots)
        enqueue_us = (time.perf_counter() - t0) * 1e6
        ea.flush()
        step(
            f"node-1 prefilled turn 1: {len(chain)} blocks ({len(chain) * DEMO_BLOCK_BYTES >> 20}"
            f" MiB of KV) announced; stored() took {enqueue_us:.0f} us on the engine thread"
        )
        wait_for(
            lambda: any(
                p.node_id == "node-1" and p.prefix_blocks == len(chain)
                for p in engines[1].lookup(ns, chain).peers
            ),
            10,
            "node-1's blocks to be visible in the directory",
        )
        turn2 = block_chain([*turn1, *(rng.randrange(128_000) for _ in range(512))], 16)
        for e, name in ((engines[1], "node-2"), (engines[2], "node-3")):
            look = e.lookup(ns, turn2)
            best = look.peers[0]
            dst = e.allocate(ns, best.prefix_blocks)
            got = e.fetch(ns, turn2[: best.prefix_blocks], dst.slots)
            same = all(
                bytes(e.slot_view(ns, s)) == _kv_bytes(h)
                for h, s in zip(turn2, dst.slots[: got.valid_blocks], strict=False)
            )
            print(
                f"    {name}: turn 2 has {len(turn2)} blocks, {best.node_id} holds "
                f"{best.prefix_blocks}; fetched {got.valid_blocks} blocks "
                f"({got.bytes >> 20} MiB) over {got.transport} in {got.seconds * 1e3:.1f} ms; "
                f"bytes identical: {same}"
            )
            check(
                got.valid_blocks == len(chain) and same,
                f"{name} fetch returned {got.valid_blocks} blocks, identical={same}",
            )
        addrs = ",".join(cluster.grpc_addresses)
        for what in ("status", "nodes"):
            step(f"kvdir ctl {what}")
            cmd = [sys.executable, "-m", "kvdir.cli", "ctl", what, "--addr", addrs]
            subprocess.run(cmd, check=True)
    finally:
        for e in engines:
            e.close()
        for a in agents:
            a.stop()


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
            agents_part(cluster, base, args.seed)
            step("stopping the cluster")
    step("demo finished: all checks passed")
    return 0
