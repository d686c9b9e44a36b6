"""`kvdir bench directory`: the directory's lookup, publish, failover, compaction and memory costs.

Against a real 3-replica `LocalCluster` (three `kvdir directory serve`
processes serving the Echo baseline too) loaded through Publish:

1. publish throughput of the load itself (batches through the leader, several
   in flight);
2. single Lookup latency (one request in flight) and throughput (several
   client processes), against one follower;
3. the Echo baseline with the same request and response sizes and the same
   concurrency, interleaved with the lookups (A B B A) so drift hits both;
4. LookupBatch chains/s and per-RPC latency;
5. leader SIGKILLs under a continuous writer: the write gap, the election
   time (from the replica logs), and afterwards a linearizable check that no
   acknowledged entry was lost;
6. log compaction on replicas holding the full load, with Raft terms watched
   on every replica across it;

and, in a separate process, the table's bytes per entry at `--memory-entries`.

Results go to stdout (Markdown) and to bench/results/directory-DATE.{md,json}.
Progress goes to stderr. Every wait has a deadline and every loop a count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from bench.shape import TIER, DataShape, writer_hashes
from bench.workers import CallResult, CallTask, WorkerPool, channel, raw_method
from kvdir import report
from kvdir.core.client import DirectoryClient, DirectoryError, lookup_request
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.local import LocalCluster, Replica
from kvdir.report import Target, at_least, at_most, fmt
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
HEARTBEAT_S = 2.0
WRITER_NODE = "bench-writer"
FILLER_NODE = "bench-filler"
WRITER_BATCH = 16
KILL_EARLY_ACK_S = 0.05
"""Acks this soon after a SIGKILL can only be the dead leader's last replies (a new
leader needs at least one 150 ms election timeout), so they count as before the kill."""
QUERY_CHAINS_MAX = 1024
_TICK = os.sysconf("SC_CLK_TCK")
_FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]


# ------------------------------------------------------------------ options


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "directory",
        help="directory lookup/publish/failover benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--entries",
        type=int,
        default=None,
        help="(block, holder) entries to load (default 1000000; --quick: 60000)",
    )
    p.add_argument(
        "--memory-entries",
        type=int,
        default=None,
        help="entries of the table-memory measurement (default 10000000)",
    )
    p.add_argument("--kills", type=int, default=None, help="leader SIGKILLs (default 5)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per measured lookup/echo phase (default 10)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=4,
        help="client processes for the throughput phases (default 4)",
    )
    p.add_argument("--batch-chains", type=int, default=32, help="chains per LookupBatch")
    p.add_argument("--publish-batch", type=int, default=1024, help="entries per Publish")
    p.add_argument(
        "--publish-inflight",
        type=int,
        default=8,
        help="Publish RPCs in flight during the load (default 8)",
    )
    p.add_argument(
        "--raft-compaction-min-entries",
        type=int,
        default=None,
        help="run the replicas with this RaftTuning.compaction_min_entries "
        "(through `directory serve --tune`; default: the product default)",
    )
    p.add_argument(
        "--raft-compaction-min-time-s",
        type=float,
        default=None,
        help="run the replicas with this RaftTuning.compaction_min_time_s",
    )
    p.add_argument("--skip-memory", action="store_true", help="skip the 10M-entry table run")
    p.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke run (about a minute)"
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where to write directory-DATE.{md,json} (default bench/results)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="replica data and logs (default: a temp dir, removed on success)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Config:
    entries: int
    memory_entries: int
    kills: int
    duration_s: float
    clients: int
    batch_chains: int
    publish_batch: int
    publish_inflight: int
    compaction_min_entries: int | None
    compaction_min_time_s: float | None
    skip_memory: bool
    quick: bool
    out_dir: Path
    data_dir: str | None
    seed: int

    @property
    def tuning(self) -> RaftTuning:
        t = RaftTuning()
        if self.compaction_min_entries is not None:
            t = replace(t, compaction_min_entries=self.compaction_min_entries)
        if self.compaction_min_time_s is not None:
            t = replace(t, compaction_min_time_s=self.compaction_min_time_s)
        return t

    @property
    def raft_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.compaction_min_entries is not None:
            out["compaction_min_entries"] = self.compaction_min_entries
        if self.compaction_min_time_s is not None:
            out["compaction_min_time_s"] = self.compaction_min_time_s
        return out


def resolve(args: argparse.Namespace) -> Config:
    q = bool(args.quick)

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    out_dir = Path(args.out_dir) if args.out_dir else report.REPO_ROOT / "bench" / "results"
    cfg = Config(
        entries=pick(args.entries, 1_000_000, 60_000),
        memory_entries=pick(args.memory_entries, 10_000_000, 300_000),
        kills=pick(args.kills, 5, 2),
        duration_s=pick(args.duration, 10.0, 2.0),
        clients=args.clients,
        batch_chains=args.batch_chains,
        publish_batch=args.publish_batch,
        publish_inflight=args.publish_inflight,
        compaction_min_entries=pick(args.raft_compaction_min_entries, None, 500),
        compaction_min_time_s=pick(args.raft_compaction_min_time_s, None, 15.0),
        skip_memory=bool(args.skip_memory),
        quick=q,
        out_dir=out_dir,
        data_dir=args.dir,
        seed=args.seed,
    )
    checks = [
        (cfg.entries >= 1000, "--entries must be >= 1000"),
        (cfg.memory_entries >= 1000, "--memory-entries must be >= 1000"),
        (0 <= cfg.kills <= 100, "--kills must be 0..100"),
        (0.5 <= cfg.duration_s <= 600, "--duration must be 0.5..600 s"),
        (1 <= cfg.clients <= 64, "--clients must be 1..64"),
        (1 <= cfg.batch_chains <= 256, "--batch-chains must be 1..256"),
        (1 <= cfg.publish_batch <= 8192, "--publish-batch must be 1..8192"),
        (1 <= cfg.publish_inflight <= 256, "--publish-inflight must be 1..256"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"kvdir: error: {msg}")
    return cfg


# ------------------------------------------------------------------ helpers

_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def deadline_loop(timeout_s: float, interval_s: float) -> Iterator[int]:
    """Yield 0, 1, 2, ... every `interval_s` until `timeout_s` passed (bounded polling)."""
    end = time.monotonic() + timeout_s
    i = 0
    while time.monotonic() < end:
        yield i
        i += 1
        time.sleep(interval_s)


def ms_stats(latencies_ns: Sequence[int]) -> dict[str, float]:
    s = sorted(latencies_ns)
    if not s:
        return {
            "n": 0,
            "p50_ms": math.nan,
            "p90_ms": math.nan,
            "p99_ms": math.nan,
            "max_ms": math.nan,
            "mean_ms": math.nan,
        }
    return {
        "n": len(s),
        "p50_ms": report.percentile(s, 50) / 1e6,
        "p90_ms": report.percentile(s, 90) / 1e6,
        "p99_ms": report.percentile(s, 99) / 1e6,
        "max_ms": s[-1] / 1e6,
        "mean_ms": statistics.fmean(s) / 1e6,
    }


def proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    total = sum(vals[:8])
    idle = vals[3] + vals[4]
    return (total - idle) / _TICK, total / _TICK


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_log(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    except OSError:
        pass
    return out


def log_time(rec: dict[str, Any]) -> float:
    ts = str(rec.get("ts", "")).rstrip("Z")
    try:
        return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return math.nan


def fit_size(size_of: Callable[[int], int], target: int) -> int:
    """Largest n with size_of(n) <= target (size_of grows by about 1 per n)."""
    n = max(0, target - 8)
    for _ in range(32):
        if n > 0 and size_of(n) > target:
            n -= 1
        elif size_of(n + 1) <= target:
            n += 1
        else:
            break
    return n


def echo_like(request_bytes: int, response_bytes: int) -> bytes:
    """A serialized EchoRequest of `request_bytes` asking for a `response_bytes` reply."""
    r = fit_size(lambda n: pb.EchoResponse(payload=b"\0" * n).ByteSize(), response_bytes)
    p = fit_size(
        lambda n: pb.EchoRequest(payload=b"\0" * n, response_bytes=r).ByteSize(), request_bytes
    )
    return pb.EchoRequest(payload=b"x" * p, response_bytes=r).SerializeToString()


# ------------------------------------------------------------------ cluster


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


class Heartbeats(threading.Thread):
    """Keeps every benchmark node's lease alive for the whole run."""

    def __init__(
        self, addresses: Sequence[str], nodes: Sequence[str], incarnation: int, max_s: float
    ) -> None:
        super().__init__(name="bench-heartbeats", daemon=True)
        self.addresses, self.nodes, self.incarnation = list(addresses), list(nodes), incarnation
        self.stop_ev = threading.Event()
        self.max_s = max_s
        self.errors = 0

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        with DirectoryClient(self.addresses, timeout_s=2.0) as c:
            while not self.stop_ev.wait(HEARTBEAT_S) and time.monotonic() < end:
                for n in self.nodes:
                    try:
                        c.heartbeat(n, self.incarnation)
                    except DirectoryError:
                        self.errors += 1


class Writer(threading.Thread):
    """Publishes fresh 16-block chains back to back through the product client.

    `acks` holds (sent, acknowledged, seq) in time.monotonic(); a publish that
    fails after the client's own retries is retried with the same blocks.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        incarnation: int,
        first_seq: int,
        max_batches: int,
        max_s: float,
    ) -> None:
        super().__init__(name="bench-writer", daemon=True)
        self.addresses = list(addresses)
        self.incarnation = incarnation
        self.seq = first_seq
        self.max_batches, self.max_s = max_batches, max_s
        self.acks: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.unacked: list[int] = []
        """Seqs that failed and were not retried before the writer stopped."""
        self.stop_ev = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        last = self.seq + self.max_batches
        lengths, rkeys, gens = [65536] * WRITER_BATCH, [7] * WRITER_BATCH, [1] * WRITER_BATCH
        with DirectoryClient(self.addresses, timeout_s=5.0) as c:
            failed = False
            while not self.stop_ev.is_set() and time.monotonic() < end and self.seq < last:
                hs = writer_hashes(self.seq, WRITER_BATCH)
                addrs = [
                    (0x7E00 << 32) + (self.seq * WRITER_BATCH + i) * 65536
                    for i in range(WRITER_BATCH)
                ]
                t0 = time.monotonic()
                try:
                    c.publish(
                        WRITER_NODE,
                        self.incarnation,
                        NAMESPACE,
                        TIER,
                        hs,
                        addrs,
                        lengths,
                        rkeys,
                        gens,
                    )
                except DirectoryError as e:
                    self.errors.append(f"{time.monotonic() - t0:.2f}s {e.code.name}: {e}")
                    failed = True
                    continue
                self.acks.append((t0, time.monotonic(), self.seq))
                self.seq += 1
                failed = False
            if failed:
                self.unacked.append(self.seq)

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=30)


class StatusWatch(threading.Thread):
    """Polls every replica's ClusterStatus: (time, replica, term, leader, log length,
    last compaction s)."""

    def __init__(self, bench: Bench, max_s: float, interval_s: float = 0.1) -> None:
        super().__init__(name="bench-status-watch", daemon=True)
        self.bench, self.max_s, self.interval_s = bench, max_s, interval_s
        self.polls: list[tuple[float, str, int, str, int, float]] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self.stop_ev.wait(self.interval_s) and time.monotonic() < end:
            now = time.monotonic()
            for rid, s in self.bench.statuses().items():
                self.polls.append(
                    (now, rid, s.term, s.leader_id, s.log_entries, s.last_compaction_s)
                )

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=10)


class CpuMonitor(threading.Thread):
    """Samples machine CPU and this benchmark's own processes twice a second.

    The host may be shared: `foreign` is machine busy time not spent in the
    benchmark's processes (replicas, client workers, this process), so a
    phase can say how much of the machine something else took.
    """

    def __init__(self, pids: Callable[[], list[int]], max_s: float) -> None:
        super().__init__(name="bench-cpu-monitor", daemon=True)
        self.pids, self.max_s = pids, max_s
        self.lock = threading.Lock()
        self.busy = self.total = self.own = 0.0
        self._last: dict[int, float] = {}
        self._machine = machine_cpu()
        self.stop_ev = threading.Event()
        self.sample()

    def sample(self) -> None:
        m = machine_cpu()
        own = 0.0
        for pid in self.pids():
            now = proc_cpu_s(pid)
            if math.isnan(now):
                continue
            own += max(0.0, now - self._last.get(pid, now))
            self._last[pid] = now
        with self.lock:
            self.busy += m[0] - self._machine[0]
            self.total += m[1] - self._machine[1]
            self.own += own
            self._machine = m

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self.stop_ev.wait(0.5) and time.monotonic() < end:
            self.sample()

    def totals(self) -> tuple[float, float, float]:
        self.sample()
        with self.lock:
            return self.busy, self.total, self.own

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=5)


def load_average() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


class Prober(threading.Thread):
    """Light sequential lookups round-robin over replicas: (time, replica, latency)."""

    def __init__(self, addresses: dict[str, str], request: bytes, max_s: float) -> None:
        super().__init__(name="bench-prober", daemon=True)
        self.addresses, self.request, self.max_s = addresses, request, max_s
        self.samples: list[tuple[float, str, float]] = []
        self.errors = 0
        self.stop_ev = threading.Event()

    def run(self) -> None:
        chans = {rid: channel(a) for rid, a in self.addresses.items()}
        calls = {rid: raw_method(c, LOOKUP, "LookupResponse") for rid, c in chans.items()}
        end = time.monotonic() + self.max_s
        try:
            while not self.stop_ev.wait(0.005) and time.monotonic() < end:
                for rid, call in calls.items():
                    t0 = time.monotonic()
                    try:
                        call(self.request, timeout=5.0)
                    except grpc.RpcError:
                        self.errors += 1
                        continue
                    self.samples.append((t0, rid, time.monotonic() - t0))
        finally:
            for c in chans.values():
                c.close()

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=10)


# ------------------------------------------------------------------ the bench


class Bench:
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
        self.heartbeats: Heartbeats | None = None
        self.queries: list[int] = []
        self.lookup_reqs: list[bytes] = []
        self.echo_reqs: list[bytes] = []
        self.phases: list[dict[str, Any]] = []
        self.kill_walls: list[tuple[float, str]] = []
        self.restart_walls: list[tuple[float, str]] = []
        self.cpu = CpuMonitor(self.own_pids, max_s=6 * 3600)
        self.cpu.start()

    def own_pids(self) -> list[int]:
        pids = [os.getpid(), *(p.pid for p in self.pool.procs if p.pid is not None)]
        pids += [r.proc.pid for r in self.cluster.replicas if r.proc is not None and r.alive]
        return pids

    def phase(self, name: str, body: Callable[[], None]) -> None:
        """Run one phase, noting its wall-clock span, load average and foreign CPU use."""
        b0, t0, o0 = self.cpu.totals()
        rec: dict[str, Any] = {
            "phase": name,
            "start_wall": time.time(),
            "loadavg_start": load_average(),
        }
        self.phases.append(rec)
        try:
            body()
        finally:
            b1, t1, o1 = self.cpu.totals()
            rec["end_wall"] = time.time()
            rec["wall_s"] = rec["end_wall"] - rec["start_wall"]
            rec["loadavg_end"] = load_average()
            rec["machine_cpu_busy"] = (b1 - b0) / (t1 - t0) if t1 > t0 else math.nan
            rec["foreign_cpu_share"] = (
                max(0.0, (b1 - b0) - (o1 - o0)) / (t1 - t0) if t1 > t0 else math.nan
            )

    # --------------------------------------------------------- cluster state

    def rid(self, address: str) -> str:
        return next(r.replica_id for r in self.cluster.replicas if r.grpc_address == address)

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
            done = 0
            for r in need:
                s = self.stubs.status(r.grpc_address)
                if s is not None and s.applied_index >= target and s.leader_id:
                    done += 1
            if done == len(need):
                return time.monotonic() - t0
        raise RuntimeError(f"replicas did not catch up to index {target} within {timeout_s:.0f}s")

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

    # --------------------------------------------------------------- load

    def register(self) -> None:
        nodes = [self.shape.node_id(n) for n in range(self.shape.nodes)]
        nodes += [WRITER_NODE, FILLER_NODE]
        with DirectoryClient(self.cluster.grpc_addresses, timeout_s=10.0) as c:
            for i, n in enumerate(nodes):
                c.register_node(
                    n,
                    "127.0.0.1",
                    self.incarnation,
                    f"127.0.0.1:{9000 + i}",
                    ["tcp"],
                    lease_ms=LEASE_MS,
                )
        self.heartbeats = Heartbeats(
            self.cluster.grpc_addresses, nodes, self.incarnation, max_s=6 * 3600
        )
        self.heartbeats.start()

    def publish_requests(self) -> list[bytes]:
        s = self.shape
        return [
            pb.PublishRequest(
                node_id=s.node_id(b.node),
                incarnation=self.incarnation,
                namespace=NAMESPACE,
                tier=pb.TIER_GPU,
                block_hashes=b.hashes,
                addresses=b.addresses,
                lengths=b.lengths,
                rkeys=b.rkeys,
                generations=b.generations,
            ).SerializeToString()
            for b in s.batches(self.cfg.publish_batch)
        ]

    def load(self) -> None:
        cfg = self.cfg
        self.results["data_shape"] = {
            **self.shape.describe(),
            "namespace": f"{NAMESPACE.model} {NAMESPACE.dtype} {NAMESPACE.block_tokens} tokens "
            f"{NAMESPACE.layout}",
            "publish_batch_entries": cfg.publish_batch,
            "layout": "chain c is published by node c % 16; every 5th chain also by a second "
            "node, so those blocks have two holders and take the multi-holder lookup path",
        }
        reqs = self.publish_requests()
        leader = self.leader()
        procs = min(self.pool.size, cfg.publish_inflight)
        threads = math.ceil(cfg.publish_inflight / procs)
        say(
            f"loading {self.shape.entries:,} entries as {len(reqs)} Publish RPCs of "
            f"<= {cfg.publish_batch} through leader {leader.replica_id} "
            f"({procs} processes x {threads} threads in flight)"
        )
        start_at = time.time() + 1.0
        tasks = [
            CallTask(
                leader.grpc_address,
                PUBLISH,
                "PublishResponse",
                reqs[w::procs],
                start_at,
                0.0,
                len(reqs),
                threads=threads,
                timeout_s=30.0,
                sum_field="applied",
            )
            for w in range(procs)
        ]
        cpu0, pid_cpu0 = machine_cpu(), self._pids_cpu()
        res = self.pool.run(tasks, timeout_s=max(300.0, self.shape.entries / 2000))
        cpu1, pid_cpu1 = machine_cpu(), self._pids_cpu()
        window = max(r.finished for r in res) - min(r.started for r in res)
        applied = sum(r.summed for r in res)
        lat = [x for r in res for x in r.latencies_ns]
        errors = self._merge_errors(res)
        failed = sum(r.failed for r in res)
        caught_s = self.wait_caught_up(120.0)
        st = self.statuses()
        self.results["publish"] = {
            "what": "the initial load: every entry published once, batches straight to the "
            "leader, committed (acknowledged after the leader applied it)",
            "entries": self.shape.entries,
            "entries_applied": applied,
            "rpcs": len(reqs),
            "rpcs_failed": failed,
            "batch_entries": cfg.publish_batch,
            "inflight": procs * threads,
            "wall_s": window,
            "entries_per_s": applied / window if window > 0 else math.nan,
            "rpc_latency": ms_stats(lat),
            "errors": errors,
            "machine_cpu_busy": self._busy(cpu0, cpu1),
            "replica_cpu_s": {k: pid_cpu1[k] - pid_cpu0[k] for k in pid_cpu0},
            "followers_caught_up_after_s": caught_s,
            "replica_entries": {k: s.entries for k, s in st.items()},
            "leader": leader.replica_id,
        }
        say(
            f"load: {applied:,} entries in {window:.2f}s = "
            f"{fmt(applied / window)} entries/s; failed RPCs {failed}"
        )
        for k, s in st.items():
            if s.entries != self.shape.entries:
                raise RuntimeError(f"{k} holds {s.entries} entries, expected {self.shape.entries}")

    def _pids_cpu(self) -> dict[str, float]:
        return {
            r.replica_id: proc_cpu_s(r.proc.pid)
            for r in self.cluster.replicas
            if r.proc is not None and r.alive
        }

    @staticmethod
    def _busy(c0: tuple[float, float], c1: tuple[float, float]) -> float:
        dt_total = c1[1] - c0[1]
        return (c1[0] - c0[0]) / dt_total if dt_total > 0 else math.nan

    @staticmethod
    def _merge_errors(res: Sequence[CallResult]) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in res:
            for k, v in r.errors.items():
                out[k] = out.get(k, 0) + v
        return out

    # ------------------------------------------------------------- lookups

    def prepare_lookups(self, target: Replica) -> dict[str, Any]:
        """Pick query chains, check one lookup of each, size the Echo twins."""
        s = self.shape
        n = min(s.chains, QUERY_CHAINS_MAX)
        self.queries = self.rng.sample(range(s.chains), n)
        self.lookup_reqs = [
            lookup_request(NAMESPACE, s.chain_hashes(c)).SerializeToString() for c in self.queries
        ]
        ch = channel(target.grpc_address)
        call = raw_method(ch, LOOKUP, "LookupResponse")
        wrong = 0
        sizes: list[tuple[int, int]] = []
        cache: dict[tuple[int, int], bytes] = {}
        self.echo_reqs = []
        try:
            for c, req in zip(self.queries, self.lookup_reqs, strict=True):
                resp = call(req, timeout=10.0)
                got = sorted((m.node_id, m.prefix_blocks) for m in resp.matches)
                want = sorted((s.node_id(h), s.chain_blocks) for h in s.holders(c))
                wrong += got != want
                key = (len(req), resp.ByteSize())
                sizes.append(key)
                if key not in cache:
                    cache[key] = echo_like(*key)
                self.echo_reqs.append(cache[key])
        finally:
            ch.close()
        echo_req = [len(e) for e in self.echo_reqs]
        echo_resp = [
            pb.EchoResponse(payload=b"\0" * pb.EchoRequest.FromString(e).response_bytes).ByteSize()
            for e in cache.values()
        ]
        return {
            "query_chains": n,
            "multi_holder_queries": sum(len(s.holders(c)) > 1 for c in self.queries),
            "wrong_answers": wrong,
            "lookup_request_bytes_mean": statistics.fmean(x for x, _ in sizes),
            "lookup_response_bytes_mean": statistics.fmean(y for _, y in sizes),
            "lookup_response_bytes_distinct": sorted({y for _, y in sizes}),
            "echo_request_bytes_mean": statistics.fmean(echo_req),
            "echo_response_bytes_distinct": sorted(set(echo_resp)),
        }

    def rpc_phase(
        self,
        target: Replica,
        method: str,
        response: str,
        reqs: list[bytes],
        concurrency: int,
        duration_s: float,
    ) -> tuple[list[CallResult], dict[str, Any]]:
        procs = min(self.pool.size, concurrency)
        threads = math.ceil(concurrency / procs)
        start_at = time.time() + 0.5
        tasks = [
            CallTask(
                target.grpc_address,
                method,
                response,
                reqs,
                start_at,
                duration_s,
                max_calls=int(duration_s * 50_000),
                threads=threads,
                first=(w * len(reqs)) // procs,
                warmup_calls=5,
                timeout_s=10.0,
            )
            for w in range(procs)
        ]
        assert target.proc is not None
        pid = target.proc.pid
        c0, p0 = machine_cpu(), proc_cpu_s(pid)
        res = self.pool.run(tasks, timeout_s=duration_s + 60)
        c1, p1 = machine_cpu(), proc_cpu_s(pid)
        window = max(r.finished for r in res) - min(r.started for r in res)
        calls = sum(r.calls for r in res)
        return res, {
            "calls": calls,
            "window_s": window,
            "server_cpu_s": p1 - p0,
            "machine_busy_cpu_s": c1[0] - c0[0],
            "machine_total_cpu_s": c1[1] - c0[1],
        }

    def measure(
        self,
        target: Replica,
        method: str,
        response: str,
        reqs: list[bytes],
        concurrency: int,
        duration_s: float,
    ) -> dict[str, Any]:
        """Run the calls for `duration_s` (one client task per process) and summarise."""
        res, agg = self.rpc_phase(target, method, response, reqs, concurrency, duration_s)
        lat = [x for r in res for x in r.latencies_ns]
        idx = [x for r in res for x in r.indices]
        calls, window = agg["calls"], agg["window_s"]
        total = agg["machine_total_cpu_s"]
        out: dict[str, Any] = {
            "concurrency": concurrency,
            "calls": calls,
            "per_s": calls / window if window > 0 else math.nan,
            **ms_stats(lat),
            "errors": self._merge_errors(res),
            "server_cpu_us_per_call": agg["server_cpu_s"] / calls * 1e6 if calls else math.nan,
            "machine_cpu_busy": agg["machine_busy_cpu_s"] / total if total > 0 else math.nan,
        }
        out["_lat"], out["_idx"] = lat, idx
        return out

    def ab(self, target: Replica, concurrency: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Lookup and Echo in A B B A order, half of --duration per slice."""
        parts: dict[str, list[dict[str, Any]]] = {"lookup": [], "echo": []}
        half = self.cfg.duration_s / 2
        for kind in ("lookup", "echo", "echo", "lookup"):
            if kind == "lookup":
                m = self.measure(
                    target, LOOKUP, "LookupResponse", self.lookup_reqs, concurrency, half
                )
            else:
                m = self.measure(target, ECHO, "EchoResponse", self.echo_reqs, concurrency, half)
            parts[kind].append(m)
        return self._pool_parts(parts["lookup"]), self._pool_parts(parts["echo"])

    @staticmethod
    def _pool_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
        lat = [x for p in parts for x in p["_lat"]]
        idx = [x for p in parts for x in p["_idx"]]
        calls = sum(p["calls"] for p in parts)
        windows = sum(p["calls"] / p["per_s"] for p in parts if p["per_s"] > 0)
        errors: dict[str, int] = {}
        for p in parts:
            for k, v in p["errors"].items():
                errors[k] = errors.get(k, 0) + v
        cpu = sum(p["server_cpu_us_per_call"] * p["calls"] for p in parts if p["calls"])
        return {
            "concurrency": parts[0]["concurrency"],
            "calls": calls,
            "per_s": calls / windows if windows > 0 else math.nan,
            **ms_stats(lat),
            "errors": errors,
            "server_cpu_us_per_call": cpu / calls if calls else math.nan,
            "machine_cpu_busy": statistics.fmean(p["machine_cpu_busy"] for p in parts),
            "_lat": lat,
            "_idx": idx,
        }

    def by_kind(self, m: dict[str, Any]) -> dict[str, dict[str, float]]:
        single: list[int] = []
        multi: list[int] = []
        for ns, i in zip(m["_lat"], m["_idx"], strict=True):
            (multi if len(self.shape.holders(self.queries[i])) > 1 else single).append(ns)
        return {"single_holder": ms_stats(single), "multi_holder": ms_stats(multi)}

    def lookups(self) -> None:
        cfg = self.cfg
        leader = self.leader()
        target = next(r for r in self.cluster.replicas if r is not leader)
        say(f"lookups against follower {target.replica_id}")
        sizing = self.prepare_lookups(target)
        if sizing["wrong_answers"]:
            raise RuntimeError(f"{sizing['wrong_answers']} lookups gave a wrong answer")
        say(f"  single Lookup vs Echo, 1 in flight ({cfg.duration_s:.0f}s each, ABBA)")
        l1, e1 = self.ab(target, 1)
        say(f"  lookup p50 {l1['p50_ms']:.3f} ms, echo p50 {e1['p50_ms']:.3f} ms")
        say(f"  single Lookup vs Echo, {cfg.clients} in flight")
        ln, en = self.ab(target, cfg.clients)
        say(f"  lookups/s {fmt(ln['per_s'])}, echo/s {fmt(en['per_s'])}")

        # LookupBatch: the same chains, batch_chains per RPC.
        k = cfg.batch_chains
        order = list(range(len(self.queries)))
        self.rng.shuffle(order)
        n_batches = max(8, len(order) // k)
        batches = []
        for b in range(n_batches):
            chains = [self.queries[order[(b * k + j) % len(order)]] for j in range(k)]
            batches.append(chains)

        def batch_reqs(omit: bool) -> list[bytes]:
            return [
                pb.LookupBatchRequest(
                    lookups=[
                        lookup_request(NAMESPACE, self.shape.chain_hashes(c), omit_records=omit)
                        for c in chains
                    ]
                ).SerializeToString()
                for chains in batches
            ]

        with_records = batch_reqs(False)
        omitted = batch_reqs(True)
        say(f"  LookupBatch of {k} chains")
        b1 = self.measure(
            target, LOOKUP_BATCH, "LookupBatchResponse", with_records, 1, cfg.duration_s
        )
        bn = self.measure(
            target, LOOKUP_BATCH, "LookupBatchResponse", with_records, cfg.clients, cfg.duration_s
        )
        bo = self.measure(
            target, LOOKUP_BATCH, "LookupBatchResponse", omitted, cfg.clients, cfg.duration_s
        )
        for m in (b1, bn, bo):
            m["chains_per_s"] = m["per_s"] * k
        say(
            f"  LookupBatch chains/s {fmt(bn['chains_per_s'])} (records), "
            f"{fmt(bo['chains_per_s'])} (omit_records)"
        )

        l1_kinds, ln_kinds = self.by_kind(l1), self.by_kind(ln)
        for m in (l1, e1, ln, en, b1, bn, bo):
            del m["_lat"], m["_idx"]
        self.results["lookup"] = {
            "replica": target.replica_id,
            "role": "follower",
            "sizing": sizing,
            "latency": {**l1, "by_kind": l1_kinds},
            "throughput": {**ln, "by_kind": ln_kinds},
            "request_form": "pre-serialized LookupRequest bytes in the packed form "
            "(packed_hashes, as directory.client sends them; no client-side building); "
            "responses parsed into LookupResponse; records included; max_nodes default",
        }
        self.results["echo"] = {
            "replica": target.replica_id,
            "latency": e1,
            "throughput": en,
            "ratio_p50_1_inflight": l1["p50_ms"] / e1["p50_ms"],
            "ratio_p99_1_inflight": l1["p99_ms"] / e1["p99_ms"],
            "ratio_p50_loaded": ln["p50_ms"] / en["p50_ms"],
            "ratio_throughput": en["per_s"] / ln["per_s"],
            "server_cpu_us_per_call_lookup_minus_echo": ln["server_cpu_us_per_call"]
            - en["server_cpu_us_per_call"],
        }
        self.results["lookup_batch"] = {
            "replica": target.replica_id,
            "chains_per_rpc": k,
            "latency": b1,
            "throughput": bn,
            "throughput_omit_records": bo,
            "chains_per_s": bn["chains_per_s"],
        }

    # ------------------------------------------------------------ failover

    def _writer(self, max_s: float) -> Writer:
        w = Writer(
            self.cluster.grpc_addresses,
            self.incarnation,
            self.writer_seq,
            max_batches=2_000_000,
            max_s=max_s,
        )
        w.start()
        return w

    def _retire(self, w: Writer) -> None:
        w.finish()
        self.writer_acked += [seq for _, _, seq in w.acks]
        self.writer_unacked += w.unacked
        self.writer_seq = w.seq + 1

    def _wait_acks(self, w: Writer, after: float, count: int, timeout_s: float) -> bool:
        for _ in deadline_loop(timeout_s, 0.005):
            if sum(1 for _, t, _ in w.acks[-count - 5 :] if t > after) >= count:
                return True
        return False

    def elections(self, since_wall: float) -> list[tuple[float, str]]:
        out = []
        for r in self.cluster.replicas:
            for rec in read_log(r.log_path):
                if rec.get("msg") == "raft role changed" and rec.get("to") == 2:
                    t = log_time(rec)
                    if t >= since_wall - 0.002:
                        out.append((t, r.replica_id))
        return sorted(out)

    def failover(self) -> None:
        cfg = self.cfg
        kills: list[dict[str, Any]] = []
        w = self._writer(max_s=cfg.kills * 180 + 60)
        try:
            if not self._wait_acks(w, time.monotonic(), 50, 30.0):
                raise RuntimeError("the writer made no progress before the first kill")
            for k in range(cfg.kills):
                leader = self.leader()
                terms0 = {rid: s.term for rid, s in self.statuses().items()}
                time.sleep(1.0)  # steady writing for a moment before each kill
                if not self._wait_acks(w, time.monotonic() - 0.2, 1, 10.0):
                    raise RuntimeError("the writer stalled before a kill")
                wall = time.time()
                t_kill = time.monotonic()
                self.cluster.kill(leader, signal.SIGKILL)
                self.kill_walls.append((wall, leader.replica_id))
                say(f"kill {k + 1}/{cfg.kills}: SIGKILL leader {leader.replica_id}")
                cut = t_kill + KILL_EARLY_ACK_S
                ok = self._wait_acks(w, cut, 1, 20.0)
                acks = list(w.acks)
                before = [t for _, t, _ in acks if t <= cut]
                after = [(s, t) for s, t, _ in acks if t > cut]
                rec: dict[str, Any] = {"killed": leader.replica_id, "term_before": terms0}
                if not ok or not before or not after:
                    rec["error"] = "no acknowledged write after the kill within 20 s"
                    kills.append(rec)
                    raise RuntimeError(rec["error"])
                last_before, (first_sent, first_after) = before[-1], after[0]
                el = [e for e in self.elections(wall) if e[1] != leader.replica_id]
                new_leader = self.leader(20.0)
                rec.update(
                    {
                        "gap_s": first_after - last_before,
                        "kill_to_first_ack_s": first_after - t_kill,
                        "last_ack_before_kill_s": t_kill - last_before,
                        "first_ack_write_sent_s": first_sent - t_kill,
                        "election_s": (el[0][0] - wall) if el else None,
                        "new_leader": new_leader.replica_id,
                        "term_after": {rid: s.term for rid, s in self.statuses().items()},
                    }
                )
                # Restart the killed replica and let it catch up before the next kill.
                t_restart = time.monotonic()
                self.restart_walls.append((time.time(), leader.replica_id))
                self.cluster.launch(leader)
                rec["restart_caught_up_s"] = self.wait_caught_up(180.0, [leader])
                rec["restart_mesh_connected_s"] = (
                    time.monotonic() - t_restart + (self.wait_connected(60.0))
                )
                rec["restart_total_s"] = time.monotonic() - t_restart
                kills.append(rec)
                say(
                    f"  gap {rec['gap_s'] * 1e3:.0f} ms (election "
                    f"{fmt(rec['election_s'] and rec['election_s'] * 1e3)} ms), new leader "
                    f"{new_leader.replica_id}; {leader.replica_id} back and caught up in "
                    f"{rec['restart_total_s']:.1f}s"
                )
        finally:
            acked_during = len(w.acks)
            errors = list(w.errors)
            self._retire(w)
        gaps = [k["gap_s"] for k in kills if "gap_s" in k]
        elections = [k["election_s"] for k in kills if k.get("election_s") is not None]
        self.results["failover"] = {
            "kills": kills,
            "gaps_s": gaps,
            "gap_min_s": min(gaps) if gaps else math.nan,
            "gap_median_s": statistics.median(gaps) if gaps else math.nan,
            "gap_max_s": max(gaps) if gaps else math.nan,
            "election_median_s": statistics.median(elections) if elections else math.nan,
            "writer": {
                "client": "directory.client.DirectoryClient (product retry policy), one "
                "writer thread, Publish of 16 fresh blocks per call, all 3 replicas known",
                "acked_writes": acked_during,
                "client_errors": len(errors),
                "client_error_samples": errors[:5],
            },
            "gap_definition": "last acknowledged write before the SIGKILL to the first "
            f"acknowledged write after it; acks within {KILL_EARLY_ACK_S * 1e3:.0f} ms of the "
            "signal were sent by the dying leader and count as before",
        }

    # ----------------------------------------------------------- compaction

    def _compaction_logs(self) -> dict[str, list[dict[str, Any]]]:
        return {
            r.replica_id: [x for x in read_log(r.log_path) if x.get("msg") == "compaction done"]
            for r in self.cluster.replicas
        }

    def _window_wait(self, tuning: RaftTuning) -> dict[str, float]:
        """Seconds until each replica's compaction window opens (pysyncobj logCompactionSplit).

        pysyncobj lets replica i (by sorted Raft address) compact only during the first
        30% of its 1/N share of every compaction_min_time_s period (time.monotonic()).
        """
        period = tuning.compaction_min_time_s
        addrs = sorted(r.raft_address for r in self.cluster.replicas)
        slot = period / len(addrs)
        now = time.monotonic()
        out = {}
        for r in self.cluster.replicas:
            i = addrs.index(r.raft_address)
            start = math.floor(now / period) * period + i * slot
            end = start + 0.3 * slot
            if start <= now < end:
                out[r.replica_id] = 0.0
            else:
                out[r.replica_id] = (start if now < start else start + period) - now
        return out

    def fill_log(self, need: int, leader: Replica) -> int:
        """Commit `need` tiny Publish commands (the same entry re-published)."""
        req = pb.PublishRequest(
            node_id=FILLER_NODE,
            incarnation=self.incarnation,
            namespace=NAMESPACE,
            tier=pb.TIER_GPU,
            block_hashes=[b"\xff" * 8],
            addresses=[0],
            lengths=[1],
            rkeys=[0],
            generations=[1],
        ).SerializeToString()
        procs = self.pool.size
        per = math.ceil(need / procs)
        start_at = time.time() + 0.5
        tasks = [
            CallTask(
                leader.grpc_address,
                PUBLISH,
                "PublishResponse",
                [req] * per,
                start_at,
                0.0,
                per,
                threads=4,
                timeout_s=10.0,
            )
            for _ in range(procs)
        ]
        res = self.pool.run(tasks, timeout_s=max(120.0, need / 200))
        done = sum(r.calls for r in res)
        self.filled += done
        return done

    def compaction(self) -> None:
        cfg = self.cfg
        tuning = cfg.tuning
        threshold = tuning.compaction_min_entries
        phase_t0 = time.monotonic()
        before_logs = {k: len(v) for k, v in self._compaction_logs().items()}
        st = self.statuses()
        log_len = {k: s.log_entries for k, s in st.items()}
        say(f"compaction: raft log lengths {log_len}; compaction_min_entries {threshold}")
        bound = 3 * tuning.compaction_min_time_s + 600
        # Watch from the start: with short overrides a compaction may come during the fill.
        watch = StatusWatch(self, max_s=bound)
        prober = Prober(
            {r.replica_id: r.grpc_address for r in self.cluster.replicas},
            self.lookup_reqs[0],
            max_s=bound,
        )
        w = self._writer(max_s=bound)
        watch.start()
        prober.start()
        filled = 0
        done: dict[str, list[dict[str, Any]]] = {}
        fill_done = time.monotonic()
        try:
            for _ in range(4):
                st = self.statuses()
                short = threshold + 200 - min(s.log_entries for s in st.values())
                if short <= 0:
                    break
                say(
                    f"  committing {short:,} small Publish commands to grow the logs past "
                    f"{threshold:,}"
                )
                filled += self.fill_log(short, self.leader())
            fill_done = time.monotonic()
            waits = self._window_wait(tuning)
            say(
                f"  seconds until each replica's compaction window: "
                f"{ {k: round(v, 1) for k, v in waits.items()} }"
            )
            wait_bound = min(waits.values()) + 0.1 * tuning.compaction_min_time_s + 60
            t_done: float | None = None
            for _ in deadline_loop(wait_bound, 0.1):
                now = time.monotonic()
                logs = self._compaction_logs()
                done = {k: v[before_logs[k] :] for k, v in logs.items() if len(v) > before_logs[k]}
                if done and t_done is None:
                    t_done = now
                if t_done is not None and now - t_done > 2.0:
                    break
        finally:
            prober.finish()
            watch.finish()
            writer_acks = list(w.acks)
            self._retire(w)
        polls = watch.polls
        if not done:
            self.results["compaction"] = {
                "error": "no compaction within the wait bound",
                "log_lengths": log_len,
            }
            raise RuntimeError(self.results["compaction"]["error"])
        events: list[dict[str, Any]] = []
        for rid, recs in done.items():
            for rec in recs:
                end_wall = log_time(rec)
                events.append(
                    {
                        "replica": rid,
                        "entries": rec.get("entries"),
                        "capture_s": rec.get("capture_s"),
                        "total_s": rec.get("total_s"),
                        "done_utc": rec.get("ts"),
                        "_end_wall": end_wall,
                    }
                )
        first = min(events, key=lambda e: e["_end_wall"])
        # Map the compaction's wall-clock span onto time.monotonic() for the samples.
        offset = time.time() - time.monotonic()
        c_end = first["_end_wall"] - offset
        c_start = c_end - float(first["total_s"] or 0)
        lo, hi = c_start - 0.5, c_end + 0.5
        rids = [r.replica_id for r in self.cluster.replicas]
        # "Across the compaction": from 5 s before it began to 5 s after its dump was written.
        a_lo, a_hi = max(c_start - 5.0, phase_t0), c_end + 5.0
        near = [p for p in polls if a_lo <= p[0] <= a_hi]
        terms = {rid: sorted({p[2] for p in near if p[1] == rid}) for rid in rids}
        leaders = sorted({p[3] for p in near})
        all_terms = sorted({p[2] for p in near})
        phase_terms = {rid: sorted({p[2] for p in polls if p[1] == rid}) for rid in rids}
        role_events = [
            (log_time(x), r.replica_id, x.get("to"))
            for r in self.cluster.replicas
            for x in read_log(r.log_path)
            if x.get("msg") == "raft role changed"
        ]
        near_roles = [e for e in role_events if a_lo + offset <= e[0] <= a_hi + offset]
        write_lat = [t - s for s, t, _ in writer_acks if lo <= s <= hi]
        probe = {
            rid: max(
                (lat for t, r, lat in prober.samples if r == rid and lo <= t <= hi),
                default=math.nan,
            )
            for rid in rids
        }
        last_comp: dict[str, float] = {}
        for p in polls:
            last_comp[p[1]] = p[5]
        for e in events:
            del e["_end_wall"]
        self.results["compaction"] = {
            "trigger": (
                f"raft log grown past compaction_min_entries={threshold:,} with {filled:,} "
                "one-entry Publish commands (the replicas run "
                + (
                    "the product RaftTuning defaults"
                    if not cfg.raft_overrides
                    else f"RaftTuning overrides {cfg.raft_overrides} via `serve --tune`"
                )
                + "); pysyncobj then compacts each replica only inside its own window "
                f"(logCompactionSplit: 30% of a {tuning.compaction_min_time_s / 3:.0f} s slot "
                f"every {tuning.compaction_min_time_s:.0f} s)"
            ),
            "compaction_min_entries": threshold,
            "compaction_min_time_s": tuning.compaction_min_time_s,
            "filler_commands": filled,
            "log_lengths_before": log_len,
            "window_wait_s": min(waits.values()),
            "began_after_fill_s": c_start - fill_done,
            "events": events,
            "entries": first["entries"],
            "capture_s": first["capture_s"],
            "total_s": first["total_s"],
            "last_compaction_s_reported": last_comp,
            "terms_seen": terms,
            "leaders_seen": leaders,
            "status_polls": len(near),
            "polled_replicas": sorted({p[1] for p in near}),
            "role_changes_across": len(near_roles),
            "no_election": (
                len(all_terms) == 1
                and len(leaders) == 1
                and not near_roles
                and len({p[1] for p in near}) == len(rids)
            ),
            "across_window": "from 5 s before the compaction began (or the phase start, if "
            "later) to 5 s after its dump was written",
            "terms_seen_whole_phase": phase_terms,
            "writes_during": len(write_lat),
            "write_latency_max_ms_during": max(write_lat) * 1e3 if write_lat else math.nan,
            "lookup_latency_max_ms_during": {k: v * 1e3 for k, v in probe.items()},
            "during_window": "from 0.5 s before the compaction began to 0.5 s after its "
            "dump was written",
        }
        say(
            f"  {first['replica']} compacted {first['entries']:,} entries: capture "
            f"{first['capture_s']}s, total {first['total_s']}s; terms {terms}"
        )

    # ---------------------------------------------------------- verification

    def verify(self) -> None:
        """Linearizable lookups on every replica of every acknowledged entry."""
        s = self.shape
        self.wait_caught_up(60.0)
        out: dict[str, Any] = {}
        writer = sorted(set(self.writer_acked))
        for r in self.cluster.replicas:
            stub = self.stubs.stub[r.grpc_address]
            lost = 0
            wrong_chains = 0
            for i in range(0, s.chains, 32):
                chains = list(range(i, min(i + 32, s.chains)))
                resp = self._lin_batch(stub, [s.chain_hashes(c) for c in chains])
                for c, res in zip(chains, resp.results, strict=True):
                    got = {m.node_id: m.prefix_blocks for m in res.matches}
                    for h in s.holders(c):
                        if got.get(s.node_id(h), 0) != s.chain_blocks:
                            wrong_chains += 1
                            lost += self._missing(stub, s.chain_hashes(c), s.node_id(h))
            writer_lost = 0
            for i in range(0, len(writer), 256):
                seqs = writer[i : i + 256]
                resp = self._lin_batch(stub, [writer_hashes(q, WRITER_BATCH) for q in seqs])
                for q, res in zip(seqs, resp.results, strict=True):
                    got = {m.node_id: m.prefix_blocks for m in res.matches}
                    if got.get(WRITER_NODE, 0) != WRITER_BATCH:
                        writer_lost += self._missing(
                            stub, writer_hashes(q, WRITER_BATCH), WRITER_NODE
                        )
            st = self.stubs.status(r.grpc_address, 2.0)
            out[r.replica_id] = {
                "load_entries_lost": lost,
                "load_chains_short": wrong_chains,
                "writer_entries_lost": writer_lost,
                "entries": st.entries if st else None,
            }
        expected = s.entries + len(writer) * WRITER_BATCH + (1 if self.filled else 0)
        lost_total = max(v["load_entries_lost"] + v["writer_entries_lost"] for v in out.values())
        self.results["verification"] = {
            "method": "LookupBatch(linearizable=True, omit_records=True) on every replica of "
            "every loaded chain and every acknowledged writer batch; a short prefix is "
            "resolved block by block",
            "acknowledged_entries": s.entries + len(writer) * WRITER_BATCH,
            "acknowledged_writer_batches": len(writer),
            "writer_batches_maybe_committed_unacked": len(self.writer_unacked),
            "expected_entries_min": expected,
            "replicas": out,
            "lost_entries": lost_total,
        }
        say(
            f"verification: lost {lost_total} of {s.entries + len(writer) * WRITER_BATCH:,} "
            f"acknowledged entries (max over replicas)"
        )

    @staticmethod
    def _lin_batch(
        stub: pb_grpc.PrefixDirectoryStub, chains: Sequence[Sequence[bytes]]
    ) -> pb.LookupBatchResponse:
        req = pb.LookupBatchRequest(
            lookups=[
                pb.LookupRequest(
                    namespace=NAMESPACE, block_hashes=c, omit_records=True, max_nodes=64
                )
                for c in chains
            ],
            linearizable=True,
        )
        last: grpc.RpcError | None = None
        for _ in range(20):
            try:
                resp: pb.LookupBatchResponse = stub.LookupBatch(req, timeout=30.0)
                return resp
            except grpc.RpcError as e:
                last = e
                time.sleep(0.2)
        raise RuntimeError(f"verification lookup failed: {last}")

    def _missing(self, stub: pb_grpc.PrefixDirectoryStub, chain: Sequence[bytes], node: str) -> int:
        missing = 0
        for i in range(0, len(chain), 256):
            resp = self._lin_batch(stub, [[h] for h in chain[i : i + 256]])
            for res in resp.results:
                missing += not any(m.node_id == node for m in res.matches)
        return missing

    # ----------------------------------------------------------------- all

    def run_all(self) -> None:
        rss_empty = self.rss()
        self.register()
        self.phase("publish load", self.load)
        rss_loaded = self.rss()
        self.results["memory"] = {}
        self.results["memory"]["replicas"] = {
            "rss_bytes_empty": rss_empty,
            "rss_bytes_loaded": rss_loaded,
            "entries": self.shape.entries,
            "bytes_per_entry": {
                k: (rss_loaded[k] - rss_empty.get(k, 0)) / self.shape.entries for k in rss_loaded
            },
        }
        self.phase("lookups", self.lookups)
        self.phase("leader kills", self.failover)
        self.phase("compaction", self.compaction)
        self.phase("verification", self.verify)
        self.results["memory"]["replicas"]["rss_bytes_end"] = self.rss()

    def classify_elections(self) -> dict[str, Any]:
        """Every leader election in the replica logs, with its phase and likely cause."""
        events = []
        for r in self.cluster.replicas:
            for rec in read_log(r.log_path):
                if rec.get("msg") == "raft role changed" and rec.get("to") == 2:
                    events.append((log_time(rec), r.replica_id))
        events.sort()
        out: list[dict[str, Any]] = []
        for i, (t, rid) in enumerate(events):
            phase = next(
                (
                    p["phase"]
                    for p in self.phases
                    if p["start_wall"] - 0.01 <= t <= p.get("end_wall", math.inf)
                ),
                "start-up" if i == 0 else "between phases",
            )
            cause = "unexplained (no kill or restart just before)"
            if i == 0:
                cause = "cluster start"
            for rt, rrid in self.restart_walls:
                if rt <= t <= rt + 60.0:
                    cause = f"after restarting {rrid} (the rejoining replica's election)"
            for kt, krid in self.kill_walls:
                if kt <= t <= kt + 5.0:
                    cause = f"SIGKILL of leader {krid}"
            out.append(
                {
                    "utc": dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S.%f")[:-3],
                    "wall": t,
                    "new_leader": rid,
                    "phase": phase,
                    "cause": cause,
                }
            )
        return {
            "events": out,
            "total": len(out),
            "after_kill": sum(e["cause"].startswith("SIGKILL") for e in out),
            "after_restart": sum(e["cause"].startswith("after restarting") for e in out),
            "unexplained": sum(e["cause"].startswith("unexplained") for e in out),
        }

    def log_summary(self) -> None:
        out = {}
        for r in self.cluster.replicas:
            recs = read_log(r.log_path)
            crit = [x for x in recs if x.get("level") == "critical"]
            out[r.replica_id] = {
                "role_changes": sum(x.get("msg") == "raft role changed" for x in recs),
                "became_leader": sum(
                    x.get("msg") == "raft role changed" and x.get("to") == 2 for x in recs
                ),
                "compactions": sum(x.get("msg") == "compaction done" for x in recs),
                "critical": len(crit),
                "truncating_applied": sum(
                    "truncating already-applied" in str(x.get("msg")) for x in crit
                ),
                "errors": sum(x.get("level") == "error" for x in recs),
                "critical_samples": [f"{x.get('ts')} {x.get('msg')}" for x in crit[:2]],
            }
        self.results["replica_logs"] = out

    def close(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop_ev.set()
            self.heartbeats.join(timeout=10)
            self.results.setdefault("misc", {})["heartbeat_errors"] = self.heartbeats.errors
        self.stubs.close()
        self.cpu.finish()
        self.log_summary()
        self.results["phases"] = self.phases
        self.results["elections"] = self.classify_elections()


# ------------------------------------------------------------------ memory


def table_memory(entries: int) -> dict[str, Any]:
    say(f"table memory at {entries:,} entries (separate process)")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--entries", str(entries)],
        capture_output=True,
        text=True,
        timeout=max(600.0, entries / 20_000),
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement failed: {proc.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    say(f"  {out['bytes_per_entry']:.1f} bytes per entry")
    return out


# ------------------------------------------------------------------ report


def targets(r: dict[str, Any]) -> list[Target]:
    def get(*path: str) -> float | None:
        cur: Any = r
        for p in path:
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return float(cur) if isinstance(cur, int | float) else None

    lost = get("verification", "lost_entries")
    no_el = r.get("compaction", {}).get("no_election")
    out = [
        at_most(
            "lookup_p50",
            "Lookup p50, 500-block chain, 1 in flight",
            get("lookup", "latency", "p50_ms"),
            1.0,
            "ms",
        ),
        Target(
            "lookup_p99",
            "Lookup p99, 1 in flight",
            "-",
            get("lookup", "latency", "p99_ms"),
            "ms",
            None,
        ),
        at_least(
            "lookup_rate",
            "Lookups/s per replica (several clients)",
            get("lookup", "throughput", "per_s"),
            2500,
            "/s",
        ),
        at_least(
            "batch_rate",
            "LookupBatch chains/s per replica",
            get("lookup_batch", "chains_per_s"),
            25_000,
            "/s",
        ),
        Target(
            "batch_p50",
            "LookupBatch p50 per RPC, 1 in flight",
            "-",
            get("lookup_batch", "latency", "p50_ms"),
            "ms",
            None,
        ),
        at_most(
            "echo_ratio",
            "Lookup p50 / Echo p50 (same sizes, 1 in flight)",
            get("echo", "ratio_p50_1_inflight"),
            1.5,
            "x",
        ),
        Target(
            "echo_ratio_loaded",
            "Lookup p50 / Echo p50 under load",
            "-",
            get("echo", "ratio_p50_loaded"),
            "x",
            None,
        ),
        at_least(
            "publish_rate",
            "Committed publish entries/s (leader, batched)",
            get("publish", "entries_per_s"),
            100_000,
            "/s",
        ),
        at_most(
            "gap_median", "Leader-kill write gap, median", get("failover", "gap_median_s"), 0.3, "s"
        ),
        at_most("gap_max", "Leader-kill write gap, max", get("failover", "gap_max_s"), 1.0, "s"),
        at_most("lost", "Acknowledged entries lost", lost, 0, ""),
        Target(
            "compaction_no_election",
            "No election across compaction (terms unchanged)",
            "yes",
            None if no_el is None else float(no_el),
            "bool",
            None if no_el is None else bool(no_el),
        ),
        Target(
            "compaction_capture",
            "Compaction capture on the Raft thread",
            "-",
            get("compaction", "capture_s"),
            "s",
            None,
        ),
        at_most(
            "memory",
            "Table bytes per entry at --memory-entries",
            get("memory", "table", "bytes_per_entry"),
            200,
            "B",
        ),
    ]
    return out


def markdown(data: dict[str, Any]) -> str:
    h = data["header"]
    r = data["results"]
    cfg = data["config"]
    parts = [
        f"# kvdir directory benchmark, {h['started_utc'][:10]}",
        "",
        report.header_markdown(h),
        "",
        "## Targets",
        "",
        report.targets_table([Target(**_target_kwargs(t)) for t in data["targets"]]),
        "",
    ]
    ds = r.get("data_shape")
    if ds:
        parts += [
            "## Data shape",
            "",
            f"A 3-replica LocalCluster (real `kvdir directory serve` processes, Echo enabled) "
            f"on this machine, loaded with **{ds['entries']:,}** (block, holder) entries: "
            f"{ds['nodes']} holder nodes, {ds['chains']:,} chains of {ds['chain_blocks']} "
            f"blocks ({ds['distinct_blocks']:,} distinct {ds['hash_bytes']}-byte hashes); "
            f"{ds['multi_holder_chains']:,} chains ({ds['multi_holder_fraction']:.0%}) are "
            f"also held by a second node. Publish batches of {ds['publish_batch_entries']} "
            f"entries, one node per batch. Client and replicas share the machine's "
            f"{h['machine']['cores']} cores.",
            "",
        ]
    if "publish" in r:
        p = r["publish"]
        parts += [
            "## Publish (the load)",
            "",
            report.table(
                [
                    ("entries/s", p["entries_per_s"]),
                    ("wall time", f"{fmt(p['wall_s'])} s"),
                    ("RPCs (failed)", f"{p['rpcs']:,} ({p['rpcs_failed']})"),
                    ("in flight", p["inflight"]),
                    (
                        "RPC p50 / p99",
                        f"{fmt(p['rpc_latency']['p50_ms'])} / {fmt(p['rpc_latency']['p99_ms'])} ms",
                    ),
                    ("machine CPU busy", f"{p['machine_cpu_busy']:.0%}"),
                    (
                        "replica CPU s",
                        ", ".join(f"{k} {v:.1f}" for k, v in p["replica_cpu_s"].items()),
                    ),
                    ("followers caught up", f"{fmt(p['followers_caught_up_after_s'])} s after"),
                ],
                ["", ""],
            ),
            "",
        ]
    if "lookup" in r:
        lk, ec, lb = r["lookup"], r["echo"], r["lookup_batch"]
        sz = lk["sizing"]
        rows: list[tuple[Any, ...]] = []
        for name, m, unit in (
            ("Lookup, 1 in flight", lk["latency"], "lookups/s"),
            ("Echo, 1 in flight", ec["latency"], "echo/s"),
            (f"Lookup, {lk['throughput']['concurrency']} in flight", lk["throughput"], "lookups/s"),
            (f"Echo, {ec['throughput']['concurrency']} in flight", ec["throughput"], "echo/s"),
            (f"LookupBatch x{lb['chains_per_rpc']}, 1 in flight", lb["latency"], "chains/s"),
            (
                f"LookupBatch x{lb['chains_per_rpc']}, {lb['throughput']['concurrency']} in flight",
                lb["throughput"],
                "chains/s",
            ),
            (
                f"LookupBatch x{lb['chains_per_rpc']} omit_records, "
                f"{lb['throughput_omit_records']['concurrency']} in flight",
                lb["throughput_omit_records"],
                "chains/s",
            ),
        ):
            rate = m.get("chains_per_s", m["per_s"])
            rows.append(
                (
                    name,
                    m["p50_ms"],
                    m["p99_ms"],
                    m["max_ms"],
                    f"{fmt(rate)} {unit}",
                    m["server_cpu_us_per_call"],
                    f"{m['machine_cpu_busy']:.0%}",
                    sum(m["errors"].values()),
                )
            )
        kinds = lk["latency"]["by_kind"]
        parts += [
            f"## Lookup, LookupBatch and the Echo baseline (replica {lk['replica']}, a follower)",
            "",
            report.table(
                rows,
                [
                    "",
                    "p50 ms",
                    "p99 ms",
                    "max ms",
                    "rate",
                    "server CPU us/call",
                    "machine CPU",
                    "errors",
                ],
            ),
            "",
            f"Lookup / Echo p50 ratio: {fmt(ec['ratio_p50_1_inflight'])}x at 1 in flight, "
            f"{fmt(ec['ratio_p50_loaded'])}x under load; p99 ratio at 1 in flight "
            f"{fmt(ec['ratio_p99_1_inflight'])}x. Echo served {fmt(ec['ratio_throughput'])}x "
            f"the lookup rate. Server CPU per call, lookup minus echo: "
            f"{fmt(ec['server_cpu_us_per_call_lookup_minus_echo'])} us.",
            "",
            f"Queries: {sz['query_chains']:,} distinct full chains drawn at random "
            f"({sz['multi_holder_queries']} multi-holder), all answered correctly "
            f"before timing ({sz['wrong_answers']} wrong). Lookup request "
            f"{fmt(sz['lookup_request_bytes_mean'])} B, response "
            f"{'/'.join(str(x) for x in sz['lookup_response_bytes_distinct'])} B (one or two "
            f"holders, records included); Echo request {fmt(sz['echo_request_bytes_mean'])} B, "
            f"response {'/'.join(str(x) for x in sz['echo_response_bytes_distinct'])} B, "
            "one Echo twin per query, same order. 1-in-flight p50 by kind: single holder "
            f"{fmt(kinds['single_holder']['p50_ms'])} ms, two holders "
            f"{fmt(kinds['multi_holder']['p50_ms'])} ms. Lookup and Echo ran alternately "
            "(A B B A slices of the phase). Client processes send pre-serialized requests "
            "(the packed chain form `directory.client.lookup_request` builds) and parse the "
            "responses.",
            "",
        ]
    if "failover" in r:
        fo = r["failover"]
        rows = [
            (
                i + 1,
                k.get("killed"),
                k.get("new_leader"),
                None if k.get("gap_s") is None else k["gap_s"] * 1e3,
                None if k.get("election_s") is None else k["election_s"] * 1e3,
                None if k.get("kill_to_first_ack_s") is None else k["kill_to_first_ack_s"] * 1e3,
                k.get("restart_total_s"),
                k.get("restart_mesh_connected_s"),
            )
            for i, k in enumerate(fo["kills"])
        ]
        parts += [
            "## Leader kill (SIGKILL) under a continuous writer",
            "",
            report.table(
                rows,
                [
                    "#",
                    "killed",
                    "new leader",
                    "write gap ms",
                    "election ms (log)",
                    "kill to first ack ms",
                    "restart + catch-up s",
                    "restart to full Raft mesh s",
                ],
            ),
            "",
            f"Gap min / median / max: {fmt(fo['gap_min_s'] * 1e3)} / "
            f"{fmt(fo['gap_median_s'] * 1e3)} / {fmt(fo['gap_max_s'] * 1e3)} ms. "
            f"Gap: {fo['gap_definition']}. Election: from the SIGKILL to the new leader's "
            "'raft role changed' log line. Writer: " + fo["writer"]["client"] + "; "
            f"{fo['writer']['acked_writes']:,} writes acknowledged, "
            f"{fo['writer']['client_errors']} gave up after the client's retries. Before "
            "each kill the restarted replica had caught up (applied the leader's commit "
            "index) and every replica reported every Raft peer connected.",
            "",
        ]
    logs = r.get("replica_logs")
    if logs:
        rows = [
            (
                rid,
                x["role_changes"],
                x["became_leader"],
                x["compactions"],
                x["critical"],
                x["truncating_applied"],
                x["errors"],
            )
            for rid, x in logs.items()
        ]
        parts += [
            "## Replica logs",
            "",
            report.table(
                rows,
                [
                    "replica",
                    "role changes",
                    "became leader",
                    "compactions",
                    "CRITICAL lines",
                    "of which 'truncating already-applied'",
                    "ERROR lines",
                ],
            ),
            "",
        ]
        samples = [m for x in logs.values() for m in x["critical_samples"]][:3]
        if samples:
            parts += ["Sample CRITICAL lines:", "", "```", *samples, "```", ""]
    if "compaction" in r:
        cp = r["compaction"]
        parts += ["## Log compaction", ""]
        if "error" in cp:
            parts += [f"Failed: {cp['error']}", ""]
        else:
            ev = "; ".join(
                f"{e['replica']}: {fmt(e['entries'])} entries, capture {e['capture_s']} s, "
                f"total {e['total_s']} s"
                for e in cp["events"]
            )
            probes = {k: fmt(v) for k, v in cp["lookup_latency_max_ms_during"].items()}
            parts += [
                f"Trigger: {cp['trigger']}. The first compaction began "
                f"{fmt(cp['began_after_fill_s'])} s after the logs were long enough (negative: "
                "during the fill). Compactions: "
                f"{ev}.",
                "",
                f"Across the compaction ({cp['across_window']}): terms seen on each replica "
                f"over {cp['status_polls']} status polls {cp['terms_seen']}, leaders seen "
                f"{cp['leaders_seen']}, Raft role changes in the replica logs "
                f"{cp['role_changes_across']} -> "
                f"{'no election' if cp['no_election'] else '**an election happened**'}. "
                f"(Terms over the whole phase, fill and wait included: "
                f"{cp['terms_seen_whole_phase']}; see Elections.) "
                f"During the compaction ({cp['during_window']}): "
                f"{cp['writes_during']} writes, slowest "
                f"{fmt(cp['write_latency_max_ms_during'])} ms; slowest probe lookup per "
                f"replica (ms) {probes}.",
                "",
            ]
    el = r.get("elections")
    if el:
        rows = [(e["utc"], e["new_leader"], e["phase"], e["cause"]) for e in el["events"]]
        parts += [
            "## Elections",
            "",
            f"{el['total']} leader elections in the replica logs: {el['after_kill']} after a "
            f"leader SIGKILL, {el['after_restart']} while a killed replica rejoined, "
            f"{el['unexplained']} with no kill or restart just before.",
            "",
            report.table(rows, ["UTC", "new leader", "phase", "cause"]),
            "",
        ]
    if "verification" in r:
        v = r["verification"]
        parts += [
            "## No acknowledged write lost",
            "",
            f"{v['method']}. Acknowledged entries: {v['acknowledged_entries']:,}; lost (max "
            f"over replicas): **{v['lost_entries']}**. Entries per replica at the end: "
            f"{ {k: x['entries'] for k, x in v['replicas'].items()} } (expected at least "
            f"{v['expected_entries_min']:,}).",
            "",
        ]
    mem = r.get("memory", {})
    rm = mem.get("replicas")
    if mem or rm:
        parts += ["## Memory", ""]
        t = mem.get("table")
        if t and not t.get("skipped"):
            acc = t.get("accounted_bytes_per_entry", {})
            parts += [
                f"Table alone, built in a fresh process through `Table.apply(Publish)` with the "
                f"same data shape: **{t['bytes_per_entry']:.1f} bytes per entry** at "
                f"{t['entries']:,} entries (RSS {t['rss_before_bytes'] / 2**20:.0f} -> "
                f"{t['rss_after_bytes'] / 2**20:.0f} MiB; applied at "
                f"{fmt(t['apply_entries_per_s'])} entries/s). Accounted for: "
                + ", ".join(f"{k} {v:.1f}" for k, v in acc.items())
                + " bytes/entry; the rest is allocator slack and container over-allocation.",
                "",
            ]
        elif t:
            parts += ["Table measurement skipped (--skip-memory).", ""]
        if rm:
            rows_m: list[tuple[Any, ...]] = [
                (k, rm["rss_bytes_empty"].get(k, 0) / 2**20, v / 2**20, rm["bytes_per_entry"][k])
                for k, v in rm["rss_bytes_loaded"].items()
            ]
            parts += [
                f"Replica processes (VmRSS) at the {rm['entries']:,}-entry load:",
                "",
                report.table(rows_m, ["replica", "empty MiB", "loaded MiB", "growth B/entry"]),
                "",
            ]
    ph = r.get("phases")
    if ph:
        rows = [
            (
                p["phase"],
                p.get("wall_s"),
                p.get("machine_cpu_busy"),
                p.get("foreign_cpu_share"),
                " / ".join(
                    str(x) for x in p.get("loadavg_start", [])[:1] + p.get("loadavg_end", [])[:1]
                ),
            )
            for p in ph
        ]
        parts += [
            "## Host load per phase",
            "",
            "The host may be shared. 'Foreign CPU' is the share of the machine's CPU time "
            "spent outside this benchmark's processes (replicas, client workers, this "
            "process) during the phase; a large share means other workloads competed with "
            "the measurement.",
            "",
            report.table(
                rows,
                [
                    "phase",
                    "wall s",
                    "machine CPU busy",
                    "foreign CPU",
                    "1-min load avg start / end",
                ],
            ),
            "",
        ]
    if cfg:
        parts += ["## Settings", "", "```", json.dumps(cfg, indent=1), "```", ""]
    if data.get("error"):
        parts += ["## Error", "", "```", data["error"], "```", ""]
    return "\n".join(parts)


def _target_kwargs(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": t["key"],
        "name": t["name"],
        "goal": t["goal"],
        "measured": t["measured"],
        "unit": t["unit"],
        "passed": t["pass"],
    }


# ------------------------------------------------------------------ entry


def make_cluster(base: str, cfg: Config) -> LocalCluster:
    """LocalCluster(size=3, enable_echo=True); Raft overrides go through `serve --tune`."""
    extra = [a for k, v in cfg.raft_overrides.items() for a in ("--tune", f"{k}={v}")]
    return LocalCluster(base, size=3, enable_echo=True, extra_args=extra)


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    data: dict[str, Any] = {"header": report.header(started)}
    data["config"] = {
        "entries": cfg.entries,
        "memory_entries": cfg.memory_entries,
        "kills": cfg.kills,
        "duration_s": cfg.duration_s,
        "clients": cfg.clients,
        "batch_chains": cfg.batch_chains,
        "publish_batch": cfg.publish_batch,
        "publish_inflight": cfg.publish_inflight,
        "raft_overrides": cfg.raft_overrides,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "skip_memory": cfg.skip_memory,
    }
    results: dict[str, Any] = {}
    data["results"] = results
    tmp = None if cfg.data_dir else tempfile.mkdtemp(prefix="kvdir-bench-")
    base = cfg.data_dir or tmp
    assert base is not None
    error = ""
    say(f"replica data and logs under {base}")
    try:
        with WorkerPool(cfg.clients) as pool:
            cluster = make_cluster(base, cfg)
            bench = Bench(cfg, cluster, pool)
            try:
                cluster.start(timeout_s=60)
                bench.run_all()
            finally:
                bench.close()
                results.update(bench.results)
                cluster.stop()
        mem = results.setdefault("memory", {})
        if cfg.skip_memory:
            mem["table"] = {"skipped": True}
        else:
            mem["table"] = table_memory(cfg.memory_entries)
    except Exception as e:
        import traceback

        error = traceback.format_exc()
        say(f"benchmark failed: {e!r}; replica logs kept under {base}")
        data["error"] = error
    data["header"]["wall_s"] = time.monotonic() - t0
    data["header"]["source_fingerprint_end"] = report.source_fingerprint()
    data["targets"] = [t.as_dict() for t in targets(results)]
    md = markdown(data)
    stem = f"directory-{started:%Y-%m-%d}"
    md_path, js_path = report.write(cfg.out_dir, stem, md, data)
    print(md)
    say(f"wrote {md_path} and {js_path}")
    if tmp is not None and not error:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if error else 0
