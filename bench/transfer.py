"""`kvdir bench transfer`: KV fetch throughput between real agents, and the publish path.

Against a real 3-replica `LocalCluster` and three real `kvdir agent serve`
processes on this host: holder A (tcp,shm), reader B (tcp only) and reader C
(tcp,shm, so its fetches from A go over shared memory):

1. Fetch of `--sizes-mb` MiB of KV from A into B (tcp) and into C (shm), in
   blocks of the Llama-3-8B shape (128 KiB of KV per token): 16-token blocks
   (2 MiB) and 512-token blocks (64 MiB). The time is the engine's: from
   `EngineClient.fetch` to its answer (directory lookup, transfer, validation
   and the engine RPC). Every fetch is checked byte for byte afterwards, and
   the destination is poisoned before each one, outside the timed region.
   Baselines, interleaved with the fetches rep by rep so drift hits both:
   a raw TCP copy of the same bytes over loopback (this process receives with
   `recv_into` into a preallocated buffer; a child process sends with
   `sendall` from a buffer; one stream, kernel-default socket buffers, and
   once more with the product's 4 MiB buffers for reference) and a raw
   memcpy (memoryview slice assignment between two preallocated buffers).
2. The fixed cost of a fetch: one 64 KiB block end to end, next to an empty
   engine RPC and a bare directory lookup.
3. `EngineClient.stored()` on the caller's thread (batches of 1 and 16 blocks),
   back to back and paced, next to an empty call timed the same way.
4. Time from `stored()` to the block being visible in the reader agent's
   `EngineClient.lookup` (and on every replica), interleaved trial by trial
   with a baseline: a directory Publish from this process, then the same
   polling (the difference is the engine client's and agent's pipeline).

Results go to stdout (Markdown) and bench/results/transfer-DATE.{md,json};
progress to stderr. Every wait has a deadline and every loop a bound. Pool
files live in a temp dir under /dev/shm that is removed at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kvdir import report
from kvdir.agent.engine_client import EngineClient
from kvdir.core.client import DirectoryClient, namespace
from kvdir.core.hashing import block_chain
from kvdir.local import LOOPBACK, LocalAgent, LocalCluster
from kvdir.report import Target, at_least, at_most, fmt
from kvdir.transfer.memory import buffer_address
from kvdir.v1 import directory_pb2 as pb

MIB = 1 << 20
FIXED_BUFFER_BYTES = 4 << 20
"""A fixed SO_SNDBUF/SO_RCVBUF, compared with the kernel's autotuning (which the
product's tcp backend relies on: fixing the size gained nothing here)."""
MODEL = "meta-llama/Llama-3.1-8B"
KV_BYTES_PER_TOKEN = 128 << 10
"""Llama-3-8B: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16)."""
BLOCK_TOKENS = (16, 512)
SMALL_BLOCK_BYTES = 64 << 10
SMALL_MODEL = "kvdir-bench/64KiB-blocks"
FETCH_TIMEOUT_MS = 120_000
RPC_TIMEOUT_S = 180.0
VISIBLE_TIMEOUT_S = 5.0
POLLS_MAX = 20_000
PAGE = 4096
POISON = b"\xee" * 16
TCP_RATIO_GOAL = 0.8
SHM_RATIO_GOAL = 0.8
STORED_P99_GOAL_US = 20.0
VISIBLE_P99_GOAL_MS = 50.0
STORED_PACE_S = 0.0005
"""Sleep between paced stored() calls (each call then starts cold, as after an idle gap)."""
PROBE_NODE = "bench-probe"
MEMORY_SHARE_MAX = 0.6
"""Refuse to start when the estimated peak exceeds this share of MemAvailable."""

NS_BY_TOKENS = {t: namespace(MODEL, t, dtype="bf16", layout="vllm-paged") for t in BLOCK_TOKENS}
NS_SMALL = namespace(SMALL_MODEL, 16, dtype="bf16")

_STAMP = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_libc = ctypes.CDLL(None)
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcmp.restype = ctypes.c_int


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ options


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "transfer",
        help="KV fetch (tcp, shm) between real agents; publish latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes-mb",
        default=None,
        help="comma-separated fetch sizes in MiB (default 128,500; --quick: 64)",
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed fetches per case (default 5; --quick: 2)"
    )
    p.add_argument(
        "--overhead-reps",
        type=int,
        default=None,
        help="single-block fetches per transport (default 50; --quick: 10)",
    )
    p.add_argument(
        "--stored-calls",
        type=int,
        default=None,
        help="stored() calls per batch size (default 10000; --quick: 2000)",
    )
    p.add_argument(
        "--visibility-trials",
        type=int,
        default=None,
        help="stored()-to-visible trials (default 200; --quick: 30)",
    )
    p.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke run (about a minute)"
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where to write transfer-DATE.{md,json} (default bench/results)",
    )
    p.add_argument(
        "--poll-gap-ms",
        type=float,
        default=2.0,
        help="sleep between visibility polls (default 2; 0 polls back to back, which on a "
        "2-core machine starves the path being measured)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the benchmark's randomness")
    p.add_argument(
        "--transport",
        choices=["tcp-shm", "rdma"],
        default="tcp-shm",
        help="tcp-shm: the agent benchmark above; rdma: kvdir's RDMA READs next to "
        "perftest's ib_read_bw on this machine's RDMA device (bench/rdma.py)",
    )
    p.add_argument("--segment-mb", type=float, default=None, help="rdma: segment size (1)")
    p.add_argument("--segments", type=int, default=64, help="rdma: segments per kvdir read")
    p.add_argument("--rounds", type=int, default=5, help="rdma: interleaved rounds")
    p.add_argument("--perftest-iters", type=int, default=200, help="rdma: ib_read_bw -n")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Config:
    sizes_mib: tuple[float, ...]
    reps: int
    overhead_reps: int
    stored_calls: int
    visibility_trials: int
    quick: bool
    out_dir: Path
    seed: int
    poll_gap_s: float = 0.002


def resolve(args: argparse.Namespace) -> Config:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    sizes_raw = pick(args.sizes_mb, "128,500", "64")
    try:
        sizes = tuple(float(s) for s in str(sizes_raw).split(",") if s.strip())
    except ValueError as e:
        raise BenchError(f"--sizes-mb {sizes_raw!r}: {e}") from e
    if not sizes or any(s <= 0 for s in sizes):
        raise BenchError("--sizes-mb needs positive sizes")
    cfg = Config(
        sizes_mib=sizes,
        reps=int(pick(args.reps, 5, 2)),
        overhead_reps=int(pick(args.overhead_reps, 50, 10)),
        stored_calls=int(pick(args.stored_calls, 10_000, 2_000)),
        visibility_trials=int(pick(args.visibility_trials, 200, 30)),
        quick=quick,
        out_dir=Path(args.out_dir) if args.out_dir else report.REPO_ROOT / "bench" / "results",
        seed=int(args.seed),
        poll_gap_s=float(args.poll_gap_ms) / 1e3,
    )
    for name in ("reps", "overhead_reps", "stored_calls", "visibility_trials"):
        if getattr(cfg, name) <= 0:
            raise BenchError(f"--{name.replace('_', '-')} must be > 0")
    if cfg.poll_gap_s < 0:
        raise BenchError("--poll-gap-ms must be >= 0")
    if cfg.visibility_trials > 5_000:
        raise BenchError("--visibility-trials is at most 5000")
    return cfg


# ------------------------------------------------------------------ helpers


def say(msg: str) -> None:
    print(f"[bench transfer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def deadline_loop(timeout_s: float, limit: int = POLLS_MAX) -> Iterator[int]:
    """Yields 0, 1, ... until `limit` iterations or `timeout_s` seconds, then raises."""
    end = time.monotonic() + timeout_s
    for i in range(limit):
        if time.monotonic() > end:
            break
        yield i
    raise BenchError(f"gave up after {timeout_s:.1f}s / {limit} polls")


def ms_stats(seconds: Sequence[float]) -> dict[str, float]:
    s = sorted(x * 1e3 for x in seconds)
    return {
        "n": float(len(s)),
        "median_ms": report.percentile(s, 50),
        "min_ms": s[0],
        "p90_ms": report.percentile(s, 90),
        "p99_ms": report.percentile(s, 99),
        "max_ms": s[-1],
        "mean_ms": statistics.fmean(s),
    }


def us_stats(nanos: Sequence[int]) -> dict[str, float]:
    s = sorted(x / 1e3 for x in nanos)
    return {
        "n": float(len(s)),
        "p50_us": report.percentile(s, 50),
        "p90_us": report.percentile(s, 90),
        "p99_us": report.percentile(s, 99),
        "p999_us": report.percentile(s, 99.9),
        "max_us": s[-1],
        "mean_us": statistics.fmean(s),
    }


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """memcmp of two writable buffers (a memoryview `==` is element by element: slow)."""
    if len(a) != len(b):
        return False
    return int(_libc.memcmp(buffer_address(a), buffer_address(b), len(a))) == 0


def fill_block(view: memoryview, seed: bytes, nonce: int, index: int) -> None:
    """Distinct bytes per block and per page: a rotated random tile, each page stamped."""
    n, tile = len(view), len(seed) // 2
    rot = (index * 4099 + nonce) % tile
    src = memoryview(seed)[rot : rot + tile]
    for pos in range(0, n, tile):
        k = min(tile, n - pos)
        view[pos : pos + k] = src[:k]
    for pos in range(0, n - _STAMP.size + 1, PAGE):
        _STAMP.pack_into(view, pos, nonce ^ index, pos)


def poison(view: memoryview) -> None:
    """Scribble on a destination so a fetch that moved nothing fails verification."""
    n = len(view)
    for pos in range(0, n - len(POISON) + 1, MIB):
        view[pos : pos + len(POISON)] = POISON
    view[n - len(POISON) : n] = POISON


def segments(src_slots: Sequence[int], dst_slots: Sequence[int]) -> int:
    """How many reads the transfer's coalescing leaves (runs adjacent on both sides)."""
    pairs = sorted(zip(src_slots, dst_slots, strict=True))
    return sum(
        1
        for i, (a, b) in enumerate(pairs)
        if i == 0 or (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1) != (a, b)
    )


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def environment() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "loadavg_1m": load[0],
        "mem_available_bytes": mem_available_bytes(),
        "thp_anon": _read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": _read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "tcp_rmem": _read_text("/proc/sys/net/ipv4/tcp_rmem"),
        "tcp_wmem": _read_text("/proc/sys/net/ipv4/tcp_wmem"),
    }


def pool_spec(ns: pb.Namespace, slot_bytes: int, slots: int) -> str:
    parts = [
        f"model={ns.model}",
        f"block_tokens={ns.block_tokens}",
        f"slot_bytes={slot_bytes}",
        f"slots={slots}",
    ]
    if ns.dtype:
        parts.append(f"dtype={ns.dtype}")
    if ns.layout:
        parts.append(f"layout={ns.layout}")
    return ",".join(parts)


@dataclass
class BenchAgent(LocalAgent):
    """A LocalAgent with several pools (one per namespace)."""

    more_pools: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        cmd = super().command()
        for spec in self.more_pools:
            cmd += ["--pool", spec]
        return cmd


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM runs the cleanup (agents stopped, /dev/shm pools removed) like Ctrl-C."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# ------------------------------------------------------------ raw baselines


def raw_sender(port: int, max_bytes: int) -> None:
    """Child process of the raw-socket baseline: two connections (kernel-default and
    product-sized socket buffers); each request is a u64 length, answered with that
    many bytes by one `sendall` from a preallocated buffer; length 0 ends."""
    buf = bytearray(max_bytes)
    tile = os.urandom(MIB)
    for pos in range(0, max_bytes, MIB):
        k = min(MIB, max_bytes - pos)
        buf[pos : pos + k] = tile[:k]
    view = memoryview(buf)

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = bytearray(_U64.size)
                got = 0
                while got < _U64.size:
                    k = conn.recv_into(memoryview(head)[got:])
                    if k == 0:
                        return
                    got += k
                (n,) = _U64.unpack(head)
                if n == 0 or n > max_bytes:
                    return
                conn.sendall(view[:n])

    threads = []
    for tuned in (False, True):
        conn = socket.create_connection((LOOPBACK, port), timeout=30)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tuned:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FIXED_BUFFER_BYTES)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FIXED_BUFFER_BYTES)
        conn.sendall(b"T" if tuned else b"D")
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


class RawSocket:
    """The receiving half of the raw-socket baseline (this process)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        listener = socket.create_server((LOOPBACK, 0))
        listener.settimeout(60)
        port = listener.getsockname()[1]
        code = (
            "import sys; from bench.transfer import raw_sender; "
            "raw_sender(int(sys.argv[1]), int(sys.argv[2]))"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(port), str(max_bytes)],
            cwd=str(report.REPO_ROOT),
            start_new_session=True,
        )
        self.conns: dict[str, socket.socket] = {}
        try:
            for _ in range(2):
                conn, _ = listener.accept()
                conn.settimeout(120)
                kind = conn.recv(1)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if kind == b"T":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FIXED_BUFFER_BYTES)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FIXED_BUFFER_BYTES)
                    self.conns["tuned"] = conn
                else:
                    self.conns["default"] = conn
        except OSError as e:
            self.close()
            raise BenchError(f"raw-socket sender did not connect: {e}") from e
        finally:
            listener.close()

    def copy(self, dst: memoryview, kind: str = "default") -> float:
        conn = self.conns[kind]
        n = len(dst)
        t0 = time.perf_counter()
        conn.sendall(_U64.pack(n))
        got = 0
        while got < n:
            k = conn.recv_into(dst[got:], n - got)
            if k == 0:
                raise BenchError("raw-socket sender went away")
            got += k
        return time.perf_counter() - t0

    def close(self) -> None:
        for c in self.conns.values():
            with suppress(OSError):
                c.sendall(_U64.pack(0))
            c.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def memcpy(dst: memoryview, src: memoryview) -> float:
    t0 = time.perf_counter()
    dst[:] = src
    return time.perf_counter() - t0


# ------------------------------------------------------------------ the bench


@dataclass(frozen=True, slots=True)
class Case:
    size_mib: float
    block_tokens: int
    block_bytes: int
    blocks: int

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.blocks

    @property
    def label(self) -> str:
        return f"{self.nbytes / MIB:g} MiB, {self.block_tokens}-token blocks"


def plan(cfg: Config) -> list[Case]:
    out = []
    for size in cfg.sizes_mib:
        for tokens in BLOCK_TOKENS:
            block = tokens * KV_BYTES_PER_TOKEN
            blocks = max(1, round(size * MIB / block))
            out.append(Case(size, tokens, block, blocks))
    return out


@dataclass(slots=True)
class _Seen:
    """One stored-to-visible trial."""

    polls: int = 0
    poll_s: float = 0.0
    reader_s: float | None = None
    all_s: float | None = None


class Bench:
    def __init__(self, cfg: Config, base: str) -> None:
        self.cfg = cfg
        self.base = base
        self.rng = random.Random(cfg.seed)
        self.cases = plan(cfg)
        self.results: dict[str, Any] = {}
        self.max_bytes = max(c.nbytes for c in self.cases)
        self.slots = {
            t: max(c.blocks for c in self.cases if c.block_tokens == t) for t in BLOCK_TOKENS
        }
        self.small_slots = 32 + cfg.visibility_trials
        self.cluster = LocalCluster(os.path.join(base, "directory"), size=3)
        self.agents: dict[str, BenchAgent] = {}
        self.clients: dict[str, EngineClient] = {}
        self.directory: DirectoryClient | None = None
        self.raw: RawSocket | None = None
        self.seed_tile = os.urandom(4 * MIB)
        self.seed_tile += self.seed_tile

    # ---------------------------------------------------------------- setup

    def pool_bytes(self) -> int:
        big = sum(t * KV_BYTES_PER_TOKEN * n for t, n in self.slots.items())
        return big + SMALL_BLOCK_BYTES * self.small_slots

    def check_memory(self) -> dict[str, int]:
        # Three agents' pools (tmpfs, touched as used) + two local buffers + the sender's.
        need = 3 * self.pool_bytes() + 3 * self.max_bytes
        avail = mem_available_bytes()
        if avail and need > MEMORY_SHARE_MAX * avail:
            raise BenchError(
                f"this run needs about {need / 2**30:.1f} GiB of memory, "
                f"{avail / 2**30:.1f} GiB is available: use smaller --sizes-mb"
            )
        return {"estimated_peak_bytes": need, "mem_available_bytes": avail}

    def start(self) -> None:
        say(f"starting a 3-replica directory under {self.base}")
        self.cluster.start(timeout_s=60)
        specs = [
            pool_spec(NS_BY_TOKENS[t], t * KV_BYTES_PER_TOKEN, n) for t, n in self.slots.items()
        ]
        specs.append(pool_spec(NS_SMALL, SMALL_BLOCK_BYTES, self.small_slots))
        agents_dir = os.path.join(self.base, "agents")
        for node, transports in (
            ("holder-a", "tcp,shm"),
            ("reader-b", "tcp"),
            ("reader-c", "tcp,shm"),
        ):
            a = BenchAgent(
                node,
                agents_dir,
                self.cluster.grpc_addresses,
                specs[0],
                transports=transports,
                more_pools=specs[1:],
            )
            self.agents[node] = a
            say(f"starting agent {node} ({transports})")
            a.launch(timeout_s=60)
            self.clients[node] = EngineClient(a.engine_socket, timeout_s=RPC_TIMEOUT_S)
        self.directory = DirectoryClient(self.cluster.grpc_addresses, timeout_s=10)

    @property
    def a(self) -> EngineClient:
        return self.clients["holder-a"]

    @property
    def readers(self) -> dict[str, tuple[EngineClient, str]]:
        return {
            "tcp": (self.clients["reader-b"], "reader-b"),
            "shm": (self.clients["reader-c"], "reader-c"),
        }

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        for c in self.clients.values():
            try:
                c.close()
            except Exception as e:  # cleanup must go on
                say(f"closing an engine client: {e!r}")
        self.clients.clear()
        if self.directory is not None:
            self.directory.close()
        for a in self.agents.values():
            try:
                a.stop()
            except Exception as e:
                say(f"stopping agent {a.node_id}: {e!r}")
                a.kill()
        self.cluster.stop()

    def log_tails(self, chars: int = 1500) -> str:
        out = []
        for a in self.agents.values():
            try:
                with open(a.log_path) as f:
                    out.append(f"--- {a.node_id} ---\n{f.read()[-chars:]}")
            except OSError:
                pass
        return "\n".join(out)

    # ------------------------------------------------------------- holdings

    def store(self, ns: pb.Namespace, n: int, nonce: int) -> tuple[list[bytes], list[int]]:
        """A allocates and fills `n` blocks, stores them; waits until B and C see them."""
        tokens = [self.rng.randrange(128_000) for _ in range(n * ns.block_tokens)]
        chain = block_chain(tokens, ns.block_tokens, seed=nonce)
        alloc = self.a.allocate(ns, n)
        for i, s in enumerate(alloc.slots):
            view = self.a.slot_view(ns, s)
            fill_block(view, self.seed_tile, nonce, i)
            del view
        self.a.stored(ns, chain, alloc.slots)
        self.a.flush()
        for client, _ in self.readers.values():
            self.wait_visible(client, ns, chain, n, 30.0)
        return chain, alloc.slots

    @staticmethod
    def wait_visible(
        client: EngineClient, ns: pb.Namespace, chain: list[bytes], n: int, timeout_s: float
    ) -> int:
        polls = 0
        for _ in deadline_loop(timeout_s):
            polls += 1
            r = client.lookup(ns, chain)
            if any(p.node_id == "holder-a" and p.prefix_blocks >= n for p in r.peers):
                break
        return polls

    def verify(
        self, ns: pb.Namespace, reader: EngineClient, src: Sequence[int], dst: Sequence[int]
    ) -> None:
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            a, b = self.a.slot_view(ns, s), reader.slot_view(ns, d)
            ok = same_bytes(a, b)
            del a, b
            if not ok:
                raise BenchError(f"block {i} differs after the fetch (slot {s} -> {d})")

    def poison(self, ns: pb.Namespace, reader: EngineClient, dst: Sequence[int]) -> None:
        for d in dst:
            view = reader.slot_view(ns, d)
            poison(view)
            del view

    def fetch(
        self,
        ns: pb.Namespace,
        transport: str,
        chain: list[bytes],
        dst: list[int],
        nbytes: int,
    ) -> tuple[float, float]:
        """One timed engine-side fetch: (end-to-end seconds, agent-side seconds)."""
        client, _ = self.readers[transport]
        t0 = time.perf_counter()
        r = client.fetch(ns, chain, dst, timeout_ms=FETCH_TIMEOUT_MS)
        elapsed = time.perf_counter() - t0
        if r.valid_blocks != len(chain) or r.bytes != nbytes or r.transport != transport:
            raise BenchError(
                f"{transport} fetch: {r.valid_blocks}/{len(chain)} blocks valid, "
                f"{r.bytes}/{nbytes} bytes over {r.transport!r} from {r.source_node!r}"
            )
        return elapsed, r.seconds

    # ---------------------------------------------------------------- phases

    def fetch_cases(self) -> None:
        assert self.raw is not None
        src_buf, dst_buf = bytearray(self.max_bytes), bytearray(self.max_bytes)
        src_all, dst_all = memoryview(src_buf), memoryview(dst_buf)
        for pos in range(0, self.max_bytes, 4 * MIB):
            k = min(4 * MIB, self.max_bytes - pos)
            src_all[pos : pos + k] = self.seed_tile[:k]
        dst_all[:] = src_all  # touch every page of both before any timing
        out = []
        for case in self.cases:
            ns = NS_BY_TOKENS[case.block_tokens]
            say(f"fetch case: {case.label} ({case.blocks} blocks)")
            nonce = self.rng.getrandbits(63)
            chain, held = self.store(ns, case.blocks, nonce)
            dsts = {t: c.allocate(ns, case.blocks).slots for t, (c, _) in self.readers.items()}
            src, dst = src_all[: case.nbytes], dst_all[: case.nbytes]
            samples: dict[str, list[float]] = {
                k: []
                for k in (
                    "tcp",
                    "shm",
                    "tcp_agent",
                    "shm_agent",
                    "raw_socket",
                    "raw_socket_product_buffers",
                    "memcpy",
                )
            }
            cold: dict[str, float] = {}
            for rep in range(self.cfg.reps + 1):  # rep 0 warms up (handshake, page faults)
                got: dict[str, float] = {}
                got["raw_socket"] = self.raw.copy(dst, "default")
                got["raw_socket_product_buffers"] = self.raw.copy(dst, "tuned")
                for transport in ("tcp", "shm"):
                    client, _ = self.readers[transport]
                    self.poison(ns, client, dsts[transport])
                    e2e, agent_s = self.fetch(ns, transport, chain, dsts[transport], case.nbytes)
                    self.verify(ns, client, held, dsts[transport])
                    got[transport], got[f"{transport}_agent"] = e2e, agent_s
                    if transport == "tcp":
                        got["memcpy"] = memcpy(dst, src)
                if rep == 0:
                    cold = {name: sec * 1e3 for name, sec in got.items()}
                    continue
                for name, sec in got.items():
                    samples[name].append(sec)
            if not same_bytes(src, dst):
                raise BenchError("memcpy baseline copied wrong bytes")
            row: dict[str, Any] = {
                "size_mib_asked": case.size_mib,
                "block_tokens": case.block_tokens,
                "block_bytes": case.block_bytes,
                "blocks": case.blocks,
                "bytes": case.nbytes,
                "segments": {t: segments(held, d) for t, d in dsts.items()},
                "verified": True,
                "cold_first_ms": cold,
            }
            for name, secs in samples.items():
                st: dict[str, Any] = ms_stats(secs)
                st["gbps_median"] = case.nbytes / (st["median_ms"] / 1e3) / 1e9
                st["gbps_best"] = case.nbytes / (st["min_ms"] / 1e3) / 1e9
                st["samples_ms"] = [x * 1e3 for x in secs]
                row[name] = st
            row["tcp_vs_raw_socket"] = row["raw_socket"]["median_ms"] / row["tcp"]["median_ms"]
            row["tcp_vs_raw_socket_best"] = row["raw_socket"]["min_ms"] / row["tcp"]["min_ms"]
            row["shm_vs_memcpy"] = row["memcpy"]["median_ms"] / row["shm"]["median_ms"]
            row["shm_vs_memcpy_best"] = row["memcpy"]["min_ms"] / row["shm"]["min_ms"]
            out.append(row)
            say(
                f"  tcp {fmt(row['tcp']['median_ms'])} ms vs raw socket "
                f"{fmt(row['raw_socket']['median_ms'])} ms ({fmt(row['tcp_vs_raw_socket'])}x); "
                f"shm {fmt(row['shm']['median_ms'])} ms vs memcpy "
                f"{fmt(row['memcpy']['median_ms'])} ms ({fmt(row['shm_vs_memcpy'])}x)"
            )
            self.a.free(ns, held)
            for t, (c, _) in self.readers.items():
                c.free(ns, dsts[t])
            del src, dst
        del src_all, dst_all, src_buf, dst_buf
        self.results["fetch"] = out

    def fixed_overhead(self) -> None:
        ns = NS_SMALL
        say(
            f"fixed overhead: one {SMALL_BLOCK_BYTES >> 10} KiB block, "
            f"{self.cfg.overhead_reps} reps"
        )
        chain, held = self.store(ns, 1, self.rng.getrandbits(63))
        dsts = {t: c.allocate(ns, 1).slots for t, (c, _) in self.readers.items()}
        assert self.directory is not None
        leader = self.cluster.wait_leader(30)
        samples: dict[str, list[float]] = {
            k: []
            for k in ("tcp", "shm", "tcp_agent", "shm_agent", "engine_rpc", "directory_lookup")
        }
        reader_b = self.clients["reader-b"]
        for rep in range(self.cfg.overhead_reps + 3):  # 3 warm-up rounds
            got: dict[str, float] = {}
            for transport in ("tcp", "shm"):
                client, _ = self.readers[transport]
                self.poison(ns, client, dsts[transport])
                got[transport], got[f"{transport}_agent"] = self.fetch(
                    ns, transport, chain, dsts[transport], SMALL_BLOCK_BYTES
                )
                self.verify(ns, client, held, dsts[transport])
            t0 = time.perf_counter()
            reader_b.lookup(ns, [])  # an empty chain: the engine RPC alone
            got["engine_rpc"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            resp = self.directory.lookup(
                ns, chain, max_nodes=8, exclude_node="reader-b", address=leader.grpc_address
            )
            got["directory_lookup"] = time.perf_counter() - t0
            if not resp.matches:
                raise BenchError("the directory lost the small block")
            if rep >= 3:
                for k, v in got.items():
                    samples[k].append(v)
        self.results["fixed_overhead"] = {
            "block_bytes": SMALL_BLOCK_BYTES,
            "directory_lookup_replica": f"{leader.replica_id} (leader)",
            **{k: ms_stats(v) for k, v in samples.items()},
        }
        self.a.free(ns, held)
        for t, (c, _) in self.readers.items():
            c.free(ns, dsts[t])

    def _until_visible(self, ns: pb.Namespace, h: bytes, node_id: str, t0: float) -> _Seen:
        """Poll reader B's lookup, then every replica, until `node_id` holds `h`."""
        assert self.directory is not None
        reader_b = self.clients["reader-b"]
        seen = _Seen()
        t_poll = time.perf_counter()
        while seen.polls < POLLS_MAX and time.perf_counter() - t0 < VISIBLE_TIMEOUT_S:
            seen.polls += 1
            r = reader_b.lookup(ns, [h])
            if any(p.node_id == node_id and p.prefix_blocks >= 1 for p in r.peers):
                seen.reader_s = time.perf_counter() - t0
                break
            time.sleep(self.cfg.poll_gap_s)
        seen.poll_s = (time.perf_counter() - t_poll) / max(1, seen.polls)
        if seen.reader_s is None:
            return seen
        pending = list(self.cluster.grpc_addresses)
        for _ in range(POLLS_MAX):
            if not pending or time.perf_counter() - t0 >= VISIBLE_TIMEOUT_S:
                break
            pending = [
                addr
                for addr in pending
                if not any(
                    m.node_id == node_id
                    for m in self.directory.lookup(ns, [h], address=addr, omit_records=True).matches
                )
            ]
            if pending:
                time.sleep(self.cfg.poll_gap_s)
        if not pending:
            seen.all_s = time.perf_counter() - t0
        return seen

    def visibility(self) -> None:
        """stored() -> visible, A/B-interleaved with a direct Publish -> visible."""
        ns = NS_SMALL
        trials = self.cfg.visibility_trials
        say(f"stored() to visible: {trials} trials")
        assert self.directory is not None
        probe_inc = time.time_ns()
        self.directory.register_node(PROBE_NODE, LOOPBACK, probe_inc, lease_ms=600_000)
        alloc = self.a.allocate(ns, trials)
        runs: dict[str, list[_Seen]] = {"stored": [], "publish": []}
        publish_call: list[float] = []
        for slot in alloc.slots:
            h = os.urandom(8)
            t0 = time.perf_counter()
            self.a.stored(ns, [h], [slot])
            runs["stored"].append(self._until_visible(ns, h, "holder-a", t0))
            time.sleep(self.rng.uniform(0.0, 0.01))  # trials independent of batch windows
            h = os.urandom(8)
            t0 = time.perf_counter()
            self.directory.publish(
                PROBE_NODE, probe_inc, ns, pb.TIER_HOST, [h], [4096], [1], [1], [1]
            )
            publish_call.append(time.perf_counter() - t0)
            runs["publish"].append(self._until_visible(ns, h, PROBE_NODE, t0))
            time.sleep(self.rng.uniform(0.0, 0.01))
        self.directory.clear_node(PROBE_NODE, probe_inc, deregister=True)
        out: dict[str, Any] = {
            "trials": trials,
            "observer": "reader agent B's EngineClient.lookup (another process)",
            "baseline": "directory Publish from this process (acknowledged after the Raft "
            "commit), then the same polling",
            "publish_rpc": ms_stats(publish_call),
        }
        for name, seen in runs.items():
            reader = [x.reader_s for x in seen if x.reader_s is not None]
            every = [x.all_s for x in seen if x.all_s is not None]
            out[name] = {
                "timeouts": sum(1 for x in seen if x.reader_s is None or x.all_s is None),
                "poll_period_ms_mean": statistics.fmean(x.poll_s for x in seen) * 1e3,
                "polls_mean": statistics.fmean(x.polls for x in seen),
                "reader_lookup": ms_stats(reader) if reader else {},
                "all_replicas": ms_stats(every) if every else {},
                "reader_lookup_samples_ms": [x * 1e3 for x in reader],
            }
        self.results["visibility"] = out
        r, b = out["stored"]["reader_lookup"], out["publish"]["reader_lookup"]
        say(
            f"  stored() -> visible at the reader: p50 {fmt(r.get('median_ms'))} ms, "
            f"p99 {fmt(r.get('p99_ms'))} ms; Publish -> visible: p50 "
            f"{fmt(b.get('median_ms'))} ms, p99 {fmt(b.get('p99_ms'))} ms"
        )
        self.a.free(ns, alloc.slots)

    def stored_latency(self) -> None:
        """stored() on the caller's thread: back to back (the target), and paced."""
        ns = NS_SMALL
        calls = self.cfg.stored_calls
        say(
            f"stored() enqueue latency: {calls} calls per batch size, back to back and "
            f"paced ({STORED_PACE_S * 1e6:g} us apart)"
        )
        alloc = self.a.allocate(ns, 16)
        hashes = [os.urandom(8) for _ in range(16)]
        self.a.stored(ns, hashes, alloc.slots)
        self.a.flush()

        def empty(ns: pb.Namespace, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
            return None

        out: dict[str, Any] = {"pace_us": STORED_PACE_S * 1e6}
        for mode, pace in (("back_to_back", 0.0), ("paced", STORED_PACE_S)):
            for name, fn in (("empty_call", empty), ("stored", self.a.stored)):
                for batch in (1, 16):
                    hs, sl = hashes[:batch], alloc.slots[:batch]
                    dropped_before = self.a.dropped
                    samples = timed_calls(fn, ns, hs, sl, calls, pace)
                    key = f"{name}_batch_{batch}" + ("_paced" if mode == "paced" else "")
                    out[key] = us_stats(samples)
                    out[key]["dropped_notifications"] = float(self.a.dropped - dropped_before)
                    self.a.flush()
        for batch in (1, 16):
            s = out[f"stored_batch_{batch}"]
            say(
                f"  batch {batch}: p50 {fmt(s['p50_us'])} us, p99 {fmt(s['p99_us'])} us, "
                f"max {fmt(s['max_us'])} us"
            )
        self.results["stored_enqueue"] = out
        self.a.free(ns, alloc.slots)

    def run_all(self) -> None:
        self.start()
        self.raw = RawSocket(self.max_bytes)
        self.fetch_cases()
        self.raw.close()
        self.raw = None
        self.fixed_overhead()
        self.visibility()
        self.stored_latency()


def timed_calls(
    fn: Callable[[pb.Namespace, Sequence[bytes], Sequence[int]], None],
    ns: pb.Namespace,
    hashes: Sequence[bytes],
    slots: Sequence[int],
    calls: int,
    pace_s: float,
) -> list[int]:
    """`calls` timed calls of `fn`; `pace_s` > 0 sleeps that long between calls."""
    clock = time.perf_counter_ns
    out = [0] * calls
    gc.collect()
    for i in range(calls):
        t0 = clock()
        fn(ns, hashes, slots)
        out[i] = clock() - t0
        if pace_s:
            time.sleep(pace_s)
    return out


# ------------------------------------------------------------------ report


def targets(results: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for row in results.get("fetch", []):
        label = f"{row['bytes'] / MIB:g} MiB in {row['block_tokens']}-token blocks"
        out.append(
            at_least(
                f"tcp_vs_raw_socket_{row['bytes']}_{row['block_tokens']}",
                f"tcp fetch / raw socket copy, {label}",
                row.get("tcp_vs_raw_socket"),
                TCP_RATIO_GOAL,
                "x",
            )
        )
        out.append(
            at_least(
                f"shm_vs_memcpy_{row['bytes']}_{row['block_tokens']}",
                f"shm fetch / memcpy, {label}",
                row.get("shm_vs_memcpy"),
                SHM_RATIO_GOAL,
                "x",
            )
        )
    st = results.get("stored_enqueue", {})
    for batch in (1, 16):
        out.append(
            at_most(
                f"stored_p99_batch_{batch}",
                f"stored() p99 on the caller's thread, {batch} block"
                f"{'s' if batch > 1 else ''}, back to back",
                st.get(f"stored_batch_{batch}", {}).get("p99_us"),
                STORED_P99_GOAL_US,
                "us",
            )
        )
    vis = results.get("visibility", {}).get("stored", {})
    out.append(
        at_most(
            "visible_p99",
            "stored() to visible in the reader's lookup, p99",
            vis.get("reader_lookup", {}).get("p99_ms"),
            VISIBLE_P99_GOAL_MS,
            "ms",
        )
    )
    if vis.get("timeouts"):
        out.append(
            Target("visible_timeouts", "stored() never visible", "0", vis["timeouts"], "", False)
        )
    fo = results.get("fixed_overhead", {})
    for t in ("tcp", "shm"):
        med = fo.get(t, {}).get("median_ms")
        out.append(
            Target(
                f"fixed_overhead_{t}",
                f"fixed cost of a {t} fetch (one 64 KiB block, median)",
                "info",
                med,
                "ms",
                None,
            )
        )
    return out


def _target_from_dict(t: dict[str, Any]) -> Target:
    return Target(t["key"], t["name"], t["goal"], t["measured"], t["unit"], t["pass"])


def markdown(data: dict[str, Any]) -> str:
    h = data["header"]
    r = data.get("results", {})
    env = h.get("environment", {})
    parts = [
        "# kvdir transfer benchmark",
        "",
        report.header_markdown(h),
        "",
        f"Load average at start {fmt(env.get('start', {}).get('loadavg_1m'))}, "
        f"at end {fmt(env.get('end', {}).get('loadavg_1m'))} (1 min); "
        f"THP anon `{env.get('start', {}).get('thp_anon', '?')}`, "
        f"shmem `{env.get('start', {}).get('thp_shmem', '?')}`. "
        "GB/s are 10^9 bytes per second; MiB are 2^20 bytes.",
        "",
    ]
    if data.get("error"):
        parts += ["**The run failed:**", "", "```", data["error"].strip()[-3000:], "```", ""]
    parts += [
        "## Targets",
        "",
        report.targets_table([_target_from_dict(t) for t in data.get("targets", [])]),
        "",
    ]
    fetch = r.get("fetch", [])
    if fetch:
        rows = []
        for row in fetch:
            for kind, base, ratio in (
                ("tcp", "raw_socket", "tcp_vs_raw_socket"),
                ("shm", "memcpy", "shm_vs_memcpy"),
            ):
                rows.append(
                    (
                        f"{row['bytes'] / MIB:g} MiB",
                        f"{row['block_tokens']} "
                        f"({row['blocks']} x {row['block_bytes'] // MIB} MiB)",
                        kind,
                        row[kind]["median_ms"],
                        row[kind]["min_ms"],
                        row[kind]["gbps_median"],
                        row[f"{kind}_agent"]["median_ms"],
                        row["cold_first_ms"].get(kind),
                        base.replace("_", " "),
                        row[base]["median_ms"],
                        row[base]["gbps_median"],
                        f"{fmt(row[ratio])}x",
                        row["segments"][kind],
                    )
                )
        parts += [
            "## Fetch between two agents",
            "",
            f"Median and min of {data['config']['reps']} fetches after one warm-up; "
            "the time is the engine's (`EngineClient.fetch` call to answer: directory lookup, "
            "transfer, header validation, engine RPC); *agent* is the agent's own `seconds`. "
            "Baselines ran interleaved with the fetches, rep by rep. Raw socket: one loopback "
            "TCP stream between two processes (this one `recv_into` a preallocated buffer, a "
            "child `sendall` from a buffer), kernel-default socket buffers. memcpy: memoryview "
            "slice assignment between two preallocated, pre-touched buffers. Every fetch was "
            "checked byte for byte (destination poisoned before it). *first*: the untimed "
            "warm-up fetch (peer handshake, and the first touch of fresh pool pages on both "
            "sides); *reads*: the coalesced reads the transfer issued.",
            "",
            report.table(
                rows,
                [
                    "size",
                    "block tokens",
                    "path",
                    "median ms",
                    "min ms",
                    "GB/s",
                    "agent ms",
                    "first ms",
                    "baseline",
                    "baseline ms",
                    "baseline GB/s",
                    "ratio",
                    "reads",
                ],
            ),
            "",
            "For reference, the raw socket copy with fixed socket buffers "
            f"({FIXED_BUFFER_BYTES >> 20} MiB SO_SNDBUF/SO_RCVBUF; the product leaves "
            "them to the kernel's autotuning, the 'default buffers' column):",
            "",
            report.table(
                [
                    (
                        f"{row['bytes'] / MIB:g} MiB",
                        row["raw_socket"]["median_ms"],
                        row["raw_socket_product_buffers"]["median_ms"],
                        row["raw_socket_product_buffers"]["gbps_median"],
                    )
                    for row in fetch
                ],
                ["size", "default buffers ms", "fixed buffers ms", "fixed buffers GB/s"],
            ),
            "",
        ]
    fo = r.get("fixed_overhead")
    if fo:
        rows_o = [
            (name, fo[k]["median_ms"], fo[k]["p90_ms"], fo[k]["min_ms"])
            for name, k in (
                ("tcp fetch, end to end", "tcp"),
                ("tcp fetch, agent side", "tcp_agent"),
                ("shm fetch, end to end", "shm"),
                ("shm fetch, agent side", "shm_agent"),
                ("baseline: empty engine RPC (Lookup of no blocks)", "engine_rpc"),
                (
                    f"baseline: directory Lookup with records ({fo['directory_lookup_replica']})",
                    "directory_lookup",
                ),
            )
        ]
        parts += [
            "## Fixed cost of a fetch",
            "",
            f"One {fo['block_bytes'] >> 10} KiB block, {data['config']['overhead_reps']} fetches "
            "per transport after 3 warm-ups (peer handshake cached).",
            "",
            report.table(rows_o, ["", "median ms", "p90 ms", "min ms"]),
            "",
        ]
    st = r.get("stored_enqueue")
    if st:
        rows_s = [
            (
                name,
                batch,
                "back to back" if not suffix else "paced",
                st[k]["p50_us"],
                st[k]["p99_us"],
                st[k]["p999_us"],
                st[k]["max_us"],
                int(st[k]["dropped_notifications"]),
            )
            for suffix in ("", "_paced")
            for name, prefix in (("stored()", "stored"), ("baseline: empty call", "empty_call"))
            for batch in (1, 16)
            for k in [f"{prefix}_batch_{batch}{suffix}"]
        ]
        parts += [
            "## stored() on the caller's thread",
            "",
            f"{data['config']['stored_calls']:,} calls per batch size and mode, "
            "`time.perf_counter_ns` around each. *Back to back* (the target's row): one "
            "call after another, while the notification thread ships them (it holds the GIL "
            "while it writes the headers and builds the Notify, so it competes with the "
            f"caller). *Paced*: a {fmt(st['pace_us'])} us sleep between calls, so each call "
            "starts cold (caches and branch predictors taken by whatever ran meanwhile; "
            "see how much slower the empty call gets). The same blocks are re-stored each "
            "call. Baseline: an empty function of the same signature, timed the same way.",
            "",
            report.table(
                rows_s,
                ["call", "blocks", "mode", "p50 us", "p99 us", "p99.9 us", "max us", "dropped"],
            ),
            "",
        ]
    vis = r.get("visibility")
    if vis and vis.get("stored", {}).get("reader_lookup"):
        rows_v = [
            (name, v["median_ms"], v["p90_ms"], v["p99_ms"], v["max_ms"])
            for name, v in (
                ("stored() -> visible in reader B's lookup", vis["stored"]["reader_lookup"]),
                ("stored() -> visible on every replica", vis["stored"]["all_replicas"]),
                (
                    "baseline: Publish -> visible in reader B's lookup",
                    vis["publish"]["reader_lookup"],
                ),
                (
                    "baseline: Publish -> visible on every replica",
                    vis["publish"]["all_replicas"],
                ),
                ("baseline: the Publish RPC alone", vis["publish_rpc"]),
            )
            if v
        ]
        parts += [
            "## stored() to visible",
            "",
            f"{vis['trials']} trials, one new block each; observer: {vis['observer']}, "
            f"polled with a {fmt(data['config']['poll_gap_ms'])} ms sleep between polls (one "
            f"poll every {fmt(vis['stored']['poll_period_ms_mean'])} ms on average; polling "
            "back to back loads a small machine enough to slow the path it watches), then "
            "each replica directly. "
            f"Baseline, interleaved trial by trial: {vis['baseline']}. Timeouts "
            f"({VISIBLE_TIMEOUT_S:g} s): {vis['stored']['timeouts']} "
            f"(baseline {vis['publish']['timeouts']}).",
            "",
            report.table(rows_v, ["", "p50 ms", "p90 ms", "p99 ms", "max ms"]),
            "",
        ]
    return "\n".join(parts)


# ------------------------------------------------------------------ entry


def run(args: argparse.Namespace) -> int:
    if getattr(args, "transport", "tcp-shm") == "rdma":
        from bench import rdma

        return rdma.run(args)
    cfg = resolve(args)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    data: dict[str, Any] = {"header": report.header(started)}
    data["header"]["environment"] = {"start": environment()}
    data["config"] = {
        "sizes_mib": list(cfg.sizes_mib),
        "reps": cfg.reps,
        "overhead_reps": cfg.overhead_reps,
        "stored_calls": cfg.stored_calls,
        "visibility_trials": cfg.visibility_trials,
        "poll_gap_ms": cfg.poll_gap_s * 1e3,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "raw_socket": "two processes: this one receives, a child process sends",
    }
    results: dict[str, Any] = {}
    data["results"] = results
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    base = tempfile.mkdtemp(prefix="kvdir-bench-transfer-", dir=shm_root)
    error = ""
    say(f"agent pools, replica data and logs under {base}")
    with sigterm_as_exit():
        bench = Bench(cfg, base)
        try:
            data["config"]["memory"] = bench.check_memory()
            bench.run_all()
        except (Exception, KeyboardInterrupt, SystemExit) as e:
            import traceback

            error = traceback.format_exc()
            say(f"benchmark failed: {e!r}")
            tails = bench.log_tails()
            if tails:
                say("agent log tails:\n" + tails)
            data["error"] = error
        finally:
            results.update(bench.results)
            bench.close()
            shutil.rmtree(base, ignore_errors=True)
    data["header"]["environment"]["end"] = environment()
    data["header"]["wall_s"] = time.monotonic() - t0
    data["targets"] = [t.as_dict() for t in targets(results)]
    md = markdown(data)
    stem = f"transfer-{started:%Y-%m-%d}"
    md_path, js_path = report.write(cfg.out_dir, stem, md, data)
    print(md)
    say(f"wrote {md_path} and {js_path}")
    return 1 if error else 0
