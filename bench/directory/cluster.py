"""The cluster under test and the state the phases share (`Bench`).

`Bench` holds the 3-replica `LocalCluster`, the client worker pool, the data
shape, the seeded randomness and what one phase leaves for a later one (the
query chains, the writer's acknowledged batches, kill and restart times). Its
methods answer questions about the cluster (who leads, has everyone caught
up); the measurements themselves live in the phase modules.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

from bench.directory.config import Config
from bench.host import CpuMonitor, proc_cpu_s, rss_bytes
from bench.measure import deadline_loop
from bench.shape import DataShape
from bench.workers import CallResult, WorkerPool
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.local import LocalCluster, Replica
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

NAMESPACE = pb.Namespace(
    model="meta-llama/Llama-3.1-8B", dtype="bf16", block_tokens=16, layout="vllm-paged"
)
LOOKUP = "/kvdir.v1.PrefixDirectory/Lookup"
LOOKUP_BATCH = "/kvdir.v1.PrefixDirectory/LookupBatch"
PUBLISH = "/kvdir.v1.PrefixDirectory/Publish"
ECHO = "/kvdir.v1.Echo/Echo"
LEASE_MS = 600_000
FILLER_NODE = "bench-filler"
"""The node of the compaction phase's one-entry filler commands."""
RUN_S_MAX = 6 * 3600
"""The longest a whole run may take (bounds the background threads)."""
_FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class Stubs:
    """Raw per-replica stubs with fast reconnects (a restarted replica is seen at once)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._ch = {
            a: grpc.insecure_channel(
                a,
                options=[
                    ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
                    ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
                    *_FAST_RECONNECT,
                ],
            )
            for a in addresses
        }
        self.stub = {a: pb_grpc.PrefixDirectoryStub(c) for a, c in self._ch.items()}

    def status(self, address: str, timeout_s: float = 0.5) -> pb.ClusterStatusResponse | None:
        try:
            resp: pb.ClusterStatusResponse = self.stub[address].ClusterStatus(
                pb.ClusterStatusRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
        return resp

    def close(self) -> None:
        for c in self._ch.values():
            c.close()


def make_cluster(base: str, cfg: Config) -> LocalCluster:
    """LocalCluster(size=3, enable_echo=True); Raft overrides go through `serve --tune`."""
    extra = [a for k, v in cfg.raft_overrides.items() for a in ("--tune", f"{k}={v}")]
    return LocalCluster(base, size=3, enable_echo=True, extra_args=extra)


def merge_errors(res: Sequence[CallResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in res:
        for k, v in r.errors.items():
            out[k] = out.get(k, 0) + v
    return out


class Bench:
    """The cluster, the clients and what the phases hand each other."""

    def __init__(self, cfg: Config, cluster: LocalCluster, pool: WorkerPool) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.pool = pool
        self.shape = DataShape.for_entries(cfg.entries)
        self.rng = random.Random(cfg.seed)
        self.incarnation = time.time_ns()
        self.stubs = Stubs(cluster.grpc_addresses)
        self.results: dict[str, Any] = {}
        self.writer_seq = 0
        self.writer_acked: list[int] = []
        self.writer_unacked: list[int] = []
        self.filled = 0
        self.queries: list[int] = []
        self.lookup_reqs: list[bytes] = []
        self.echo_reqs: list[bytes] = []
        self.target: Replica | None = None
        """The follower the lookup phases measure."""
        self.phases: list[dict[str, Any]] = []
        self.kill_walls: list[tuple[float, str]] = []
        self.restart_walls: list[tuple[float, str]] = []
        self.cpu = CpuMonitor(self.own_pids, max_s=RUN_S_MAX)
        self.cpu.start()

    def own_pids(self) -> list[int]:
        pids = [os.getpid(), *(p.pid for p in self.pool.procs if p.pid is not None)]
        pids += [r.proc.pid for r in self.cluster.replicas if r.proc is not None and r.alive]
        return pids

    def statuses(self) -> dict[str, pb.ClusterStatusResponse]:
        out = {}
        for r in self.cluster.replicas:
            if r.alive:
                s = self.stubs.status(r.grpc_address)
                if s is not None:
                    out[r.replica_id] = s
        return out

    def leader(self, timeout_s: float = 30.0) -> Replica:
        """The live replica that leads and that every answering replica agrees on."""
        for _ in deadline_loop(timeout_s, 0.02):
            st = self.statuses()
            leaders = [rid for rid, s in st.items() if s.role == pb.ROLE_LEADER]
            if len(leaders) == 1 and sum(s.leader_id == leaders[0] for s in st.values()) * 2 > (
                self.cluster.size
            ):
                return next(r for r in self.cluster.replicas if r.replica_id == leaders[0])
        raise RuntimeError(f"no agreed leader within {timeout_s:.0f}s")

    def follower(self) -> Replica:
        leader = self.leader()
        return next(r for r in self.cluster.replicas if r is not leader)

    def wait_caught_up(self, timeout_s: float, need: Sequence[Replica] | None = None) -> float:
        """Wait until every live replica has applied what the leader had committed on entry."""
        t0 = time.monotonic()
        need = list(need or [r for r in self.cluster.replicas if r.alive])
        leader = self.leader(timeout_s)
        ls = self.stubs.status(leader.grpc_address, 2.0)
        if ls is None:
            raise RuntimeError("the leader did not answer ClusterStatus")
        target = ls.commit_index
        remaining = max(1.0, timeout_s - (time.monotonic() - t0))
        for _ in deadline_loop(remaining, 0.05):
            if all(self._applied(r, target) for r in need):
                return time.monotonic() - t0
        raise RuntimeError(f"replicas did not catch up to index {target} within {timeout_s:.0f}s")

    def _applied(self, r: Replica, index: int) -> bool:
        s = self.stubs.status(r.grpc_address)
        return s is not None and s.applied_index >= index and bool(s.leader_id)

    def wait_connected(self, timeout_s: float) -> float:
        """Wait until every replica reports every Raft peer connected (the full mesh)."""
        t0 = time.monotonic()
        for _ in deadline_loop(timeout_s, 0.05):
            st = self.statuses()
            if len(st) == self.cluster.size and all(
                len(s.members) == self.cluster.size and all(m.connected for m in s.members)
                for s in st.values()
            ):
                return time.monotonic() - t0
        raise RuntimeError(f"the Raft mesh did not reconnect within {timeout_s:.0f}s")

    def rss(self) -> dict[str, int]:
        return {
            r.replica_id: rss_bytes(r.proc.pid)
            for r in self.cluster.replicas
            if r.proc is not None and r.alive
        }

    def replica_cpu_s(self) -> dict[str, float]:
        return {
            r.replica_id: proc_cpu_s(r.proc.pid)
            for r in self.cluster.replicas
            if r.proc is not None and r.alive
        }

    def close(self) -> None:
        self.stubs.close()
        self.cpu.finish()
