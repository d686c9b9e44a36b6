"""The system under test: a 3-replica directory, three agents, and `Bench`, what phases share.

Holder A (tcp,shm), reader B (tcp only) and reader C (tcp,shm, so its fetches
from A go over shared memory), each with one pool per namespace. `Bench`
starts and stops them, stores blocks on A and waits until the readers see
them, and does one timed, checked fetch.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from bench.host import load_average, mem_available_bytes, read_text
from bench.measure import deadline_loop, say
from bench.transfer import blocks
from bench.transfer.config import (
    BLOCK_TOKENS,
    FETCH_TIMEOUT_MS,
    KV_BYTES_PER_TOKEN,
    MEMORY_SHARE_MAX,
    MIB,
    NS_BY_TOKENS,
    NS_SMALL,
    RPC_TIMEOUT_S,
    SMALL_BLOCK_BYTES,
    BenchError,
    Config,
)
from bench.transfer.raw import RawSocket
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient
from kvdir.core.hashing import block_chain
from kvdir.local import LocalAgent, LocalCluster
from kvdir.v1 import directory_pb2 as pb


def environment() -> dict[str, Any]:
    return {
        "loadavg_1m": (load_average() or [float("nan")])[0],
        "mem_available_bytes": mem_available_bytes(),
        "thp_anon": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "tcp_rmem": read_text("/proc/sys/net/ipv4/tcp_rmem"),
        "tcp_wmem": read_text("/proc/sys/net/ipv4/tcp_wmem"),
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
            blocks.fill_block(view, self.seed_tile, nonce, i)
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
        for polls in deadline_loop(timeout_s):
            r = client.lookup(ns, chain)
            if any(p.node_id == "holder-a" and p.prefix_blocks >= n for p in r.peers):
                return polls + 1
        raise BenchError(f"{n} stored blocks not visible to a reader within {timeout_s:.1f}s")

    def verify(
        self, ns: pb.Namespace, reader: EngineClient, src: Sequence[int], dst: Sequence[int]
    ) -> None:
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            a, b = self.a.slot_view(ns, s), reader.slot_view(ns, d)
            ok = blocks.same_bytes(a, b)
            del a, b
            if not ok:
                raise BenchError(f"block {i} differs after the fetch (slot {s} -> {d})")

    def poison(self, ns: pb.Namespace, reader: EngineClient, dst: Sequence[int]) -> None:
        for d in dst:
            view = reader.slot_view(ns, d)
            blocks.poison(view)
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
