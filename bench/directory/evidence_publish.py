"""The publishers of `kvdir bench directory --shards 4 --evidence`: spawned processes,
each running a few agent-like nodes, each node's writes going through its own
`ShardedDirectoryClient` (split by group, parts sent in parallel, one ack when
every part committed), in batches of `BATCH` entries.

What a batch holds is a function of (seed, batch number) alone (`batch_hashes`),
so the run records only which batch numbers were acknowledged, and when: the
verification replays them. A batch whose publish fails is sent again whole (a
republish of the same records is idempotent) until it is acknowledged or the
run's deadline passes; one never acknowledged is reported apart (it may or may
not have committed), never counted as acknowledged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdir.core.client import DirectoryError
from kvdir.core.sharded_client import ShardedDirectoryClient
from kvdir.v1 import directory_pb2 as pb

BATCH = 1024
"""Entries per Publish, as an agent's publisher batches them."""
NAMESPACE = pb.Namespace(
    model="meta-llama/Llama-3.1-8B", dtype="bf16", block_tokens=16, layout="vllm-paged"
)
RETRY_PAUSE_S = 0.05
"""Back-off between a failed publish and its resend (an election takes ~0.2-0.3 s)."""
CLIENT_TIMEOUT_S = 10.0
READY_S = 300.0
"""How long a node waits for the start once its client is ready (spawned processes
import gRPC and numpy first: tens of seconds on a loaded host)."""


def node_id(k: int) -> str:
    return f"ev-node-{k:02d}"


def batch_size(entries: int, b: int) -> int:
    return min(BATCH, entries - b * BATCH)


def batches(entries: int) -> int:
    return -(-entries // BATCH)


def batch_hashes(seed: int, b: int, n: int) -> list[bytes]:
    """Batch b's n block hashes: 8 uniform bytes each, replayable from (seed, b)."""
    data = np.random.default_rng([seed, b]).bytes(8 * n)
    return [data[i : i + 8] for i in range(0, 8 * n, 8)]


def node_batches(entries: int, nodes: int, k: int) -> range:
    """The batch numbers node k publishes (every nodes-th, from k)."""
    return range(k, batches(entries), nodes)


@dataclass(frozen=True, slots=True)
class Job:
    home: list[str]
    nodes: list[int]
    """Node numbers this process runs, one thread each."""
    node_count: int
    entries: int
    seed: int
    incarnation: int
    deadline_wall: float
    """time.time() after which no batch is sent again (the run's bound)."""
    out_path: str


@dataclass(frozen=True, slots=True)
class Shared:
    """What the bench process and its publishers share (multiprocessing objects)."""

    acked: Any
    """Entries acknowledged, per publisher process."""
    last_ack: Any
    """time.monotonic() of each publisher's latest acknowledgement."""
    ready: Any
    """Nodes whose client holds the shard map, per publisher process."""
    go: Any
    """Set by the bench once every node is ready: the publishing starts."""
    stop: Any


def _node(job: Job, k: int, sh: Shared, slot: int, out: dict[str, Any]) -> None:
    acks: list[int] = []
    times: list[float] = []
    unacked: list[int] = []
    failures = 0
    acked, last_ack, stop = sh.acked, sh.last_ack, sh.stop
    with ShardedDirectoryClient(job.home, timeout_s=CLIENT_TIMEOUT_S) as sc:
        with sh.ready.get_lock():
            sh.ready[slot] += 1
        if not sh.go.wait(READY_S):
            out[node_id(k)] = (acks, times, unacked, failures)
            return
        for b in node_batches(job.entries, job.node_count, k):
            n = batch_size(job.entries, b)
            hs = batch_hashes(job.seed, b, n)
            addrs = [(b * BATCH + i) * 65536 for i in range(n)]
            done = False
            while not stop.is_set() and time.time() < job.deadline_wall:
                try:
                    sc.publish(
                        node_id(k),
                        job.incarnation,
                        NAMESPACE,
                        pb.TIER_GPU,
                        hs,
                        addrs,
                        [65536] * n,
                        [1] * n,
                        [1] * n,
                    )
                    done = True
                    break
                except DirectoryError:
                    failures += 1
                    time.sleep(RETRY_PAUSE_S)  # a back-off before the resend
            if not done:
                unacked.append(b)
                if stop.is_set() or time.time() >= job.deadline_wall:
                    break
                continue
            t = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
            acks.append(b)
            times.append(t)
            with acked.get_lock():
                acked[slot] += n
            last_ack[slot] = t
    out[node_id(k)] = (acks, times, unacked, failures)


def main(job: Job, sh: Shared, slot: int) -> None:
    """One publisher process: its nodes' threads, then the record in job.out_path."""
    out: dict[str, Any] = {}
    threads = [
        threading.Thread(
            target=_node,
            args=(job, k, sh, slot, out),
            name=f"ev-{node_id(k)}",
            daemon=True,
        )
        for k in job.nodes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, job.deadline_wall - time.time() + 60.0))
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for name, (acks, times, unacked, failures) in out.items():
        arrays[f"{name}:acked"] = np.asarray(acks, dtype=np.int64)
        arrays[f"{name}:times"] = np.asarray(times, dtype=np.float64)
        arrays[f"{name}:unacked"] = np.asarray(unacked, dtype=np.int64)
        arrays[f"{name}:failures"] = np.asarray([failures], dtype=np.int64)
    np.savez(job.out_path, **arrays)  # type: ignore[arg-type]
