"""The GPU bench's cluster: a 3-replica directory, three agents with GPU-tier pools, four
real vLLM engines on one CUDA GPU, all on 127.0.0.1 (../shared/notes/vllm-gpu.md).

    a  engine + agent a (tcp, shm, cuda)      computes and saves every prefix (the holder)
    b  engine + agent b in this process       pulls a's prefixes over CUDA IPC (same host,
       (tcp, shm, cuda)                       device to device); its fetch hook lets a
                                              check make a reuse or a death race a read
    c  engine + agent c (tcp, cuda), which    pulls over the host path: a's host copies over
       publishes the host 127.0.0.2           TCP into pinned host memory, one upload
    n  engine, no connector                   recompute and plain-prefill baselines, and
                                              the reference answers

Engines start one after another (vLLM sizes its KV cache from the free memory
it profiles; a neighbour starting at the same time would skew that).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.vllm.model import write_llama_config
from kvdir.agent.config import AgentConfig, PoolConfig
from kvdir.agent.daemon import AgentDaemon
from kvdir.core.client import namespace
from kvdir.local import LOOPBACK, LocalAgent, LocalCluster, free_ports
from kvdir.v1 import directory_pb2 as pb
from tests.vllm.engines import REPO, Engine, EngineError, connector_config

BLOCK_TOKENS = 16
"""FlashAttention's block size (vLLM's CUDA default)."""
HASH_ALGO = "sha256"
OTHER_HOST = "127.0.0.2"
"""Agent c's published address: another host to its peers' holder choice."""
START_TIMEOUT_S = 600.0
LEASE_MS = 30_000
LOAD_TIMEOUT_MS = 30_000
LOOKUP_TIMEOUT_MS = 2_000
NCCL_SAFE = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off in every process (the machine's rule)."""


@dataclass(frozen=True, slots=True)
class GpuShape:
    """A Llama shape served with random weights (load_format="dummy")."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int = 128_256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_bytes(self) -> int:
        """One block of every layer: keys and values of [N, H, C] bf16 per layer."""
        return self.layers * 2 * BLOCK_TOKENS * self.kv_heads * self.head_dim * 2

    @property
    def layout(self) -> str:
        dims = f"2x{BLOCK_TOKENS}x{self.kv_heads}x{self.head_dim}"
        return f"vllm-cuda-bknhc/L{self.layers}/{dims}"

    def ns(self) -> pb.Namespace:
        return namespace(self.name, BLOCK_TOKENS, "bf16", self.layout, 0, 1)

    def describe(self) -> str:
        return (
            f"Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads / "
            f"{self.kv_heads} KV heads, MLP {self.mlp}, bf16, random weights, "
            f"{self.block_bytes // BLOCK_TOKENS // 1024} KiB of KV per token"
        )

    def write(self, path: str, max_len: int) -> str:
        dims = {
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "mlp": self.mlp,
        }
        return write_llama_config(path, dims, max_len, self.vocab, rope_theta=500000.0)


SHAPES = {
    "8b": GpuShape("kvdir-llama-8b", 32, 4096, 32, 8, 14336),
    "70b-20l": GpuShape("kvdir-llama-70b-20l", 20, 8192, 64, 8, 28672),
}


@dataclass
class GpuEngine(Engine):
    """The bench's engine driver (bench/vllm/driver.py: the connector's histograms too)
    run by this Python (the GPU machine's, which holds torch)."""

    model_name: str = ""
    max_model_len: int = 0
    llm_kwargs: dict[str, object] = field(default_factory=dict)
    start_timeout_s: float = START_TIMEOUT_S

    def driver_config(self) -> dict[str, Any]:
        return {
            "model_dir": self.model_dir,
            "model_name": self.model_name,
            "block_tokens": BLOCK_TOKENS,
            "max_model_len": self.max_model_len,
            "kv_transfer_config": self.kv_transfer_config,
            "llm_kwargs": self.llm_kwargs,
        }

    def driver_env(self) -> dict[str, str]:
        paths = [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        return {
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONHASHSEED": "0",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_LOGGING_LEVEL": "INFO",
            **NCCL_SAFE,
        }

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.vllm.gpu_driver"]

    def wait_started(self) -> None:
        """wait_ready, and if the engine died starting, the exception that ended it."""
        try:
            self.wait_ready()
        except EngineError as e:
            raise EngineError(f"{e}: {last_error(self.log_path)}") from e

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's GPU prefix cache; False while a request still holds blocks."""
        return bool(self.call({"op": "reset_prefix_cache"})["reset"])


ERROR_LINE = re.compile(
    rb"^(?:\([\w.]+ pid=\d+\) )?((?:[\w.]+\.)?\w*(?:Error|Exception)\b[^\n]*)$", re.MULTILINE
)
"""A traceback's last line; vLLM prefixes its engine core's lines "(EngineCore_DP0 pid=N)"."""
LOG_TAIL_BYTES = 256 * 1024
ERRORS_SHOWN = 3


def last_error(log_path: str) -> str:
    """The last few "SomeError: text" lines of an engine's log: the front end's own
    ("Engine core initialization failed. See root cause above.") follows the cause."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - LOG_TAIL_BYTES))
            tail = f.read()
    except OSError as e:
        return f"(no log: {e})"
    found = list(
        dict.fromkeys(m.decode(errors="replace").strip() for m in ERROR_LINE.findall(tail))
    )
    return " | ".join(found[-ERRORS_SHOWN:]) if found else "(no exception in its log)"


@dataclass
class GpuNodes:
    shape: GpuShape
    cluster: LocalCluster
    agents: dict[str, LocalAgent]
    daemon_b: AgentDaemon
    engines: dict[str, GpuEngine]

    def socket(self, name: str) -> str:
        if name == "b":
            return self.daemon_b.cfg.engine_socket
        return self.agents[name].engine_socket


def pool_spec(shape: GpuShape, slots: int) -> str:
    return (
        f"model={shape.name},dtype=bf16,block_tokens={BLOCK_TOKENS},layout={shape.layout},"
        f"tp_rank=0,tp_size=1,slot_bytes={shape.block_bytes},slots={slots},tier=gpu,gpu_device=0"
    )


def _daemon_b(cluster: LocalCluster, base: str, shape: GpuShape, slots: int) -> AgentDaemon:
    (port,) = free_ports(1)
    pool = PoolConfig(
        shape.name, BLOCK_TOKENS, shape.block_bytes, slots, "bf16", shape.layout, 0, 1, "gpu", 0
    )
    cfg = AgentConfig(
        node_id="b",
        host=LOOPBACK,
        directory=tuple(cluster.grpc_addresses),
        listen=f"{LOOPBACK}:{port}",
        engine_socket=os.path.join(base, "b.sock"),
        pools=(pool,),
        transports=("tcp", "shm", "cuda"),
        lease_ms=LEASE_MS,
        pool_dir=base,
    )
    return AgentDaemon(cfg)


def kvdir_config(socket: str) -> dict[str, Any]:
    """kvdir's connector for the agent at `socket` (the test tier's config, the bench's bounds)."""
    return connector_config(
        socket, load_timeout_ms=LOAD_TIMEOUT_MS, lookup_timeout_ms=LOOKUP_TIMEOUT_MS
    )


def gpu_engine(
    name: str, base: str, model_dir: str, shape: GpuShape, max_len: int,
    ktc: dict[str, Any] | None, memory_share: float, extra: dict[str, Any] | None = None,
) -> GpuEngine:  # fmt: skip
    """Engine `name` (not started): `ktc` is its kv_transfer_config, None for none;
    `extra`: more of vLLM's engine arguments (the bench's --no-async-scheduling)."""
    return GpuEngine(
        name,
        model_dir,
        os.path.join(base, f"{name}-engine.log"),
        ktc,
        model_name=shape.name,
        max_model_len=max_len,
        llm_kwargs={
            "gpu_memory_utilization": memory_share,
            "max_num_batched_tokens": max_len,
            "max_num_seqs": 4,
            "prefix_caching_hash_algo": HASH_ALGO,
            "enable_prefix_caching": True,
            **(extra or {}),
        },
    )


@contextlib.contextmanager
def gpu_nodes(
    base: str, shape: GpuShape, max_len: int, pool_slots: int, memory_share: float,
    extra: dict[str, Any] | None = None,
) -> Iterator[GpuNodes]:  # fmt: skip
    model_dir = shape.write(os.path.join(base, "model"), max_len)
    cluster = LocalCluster(os.path.join(base, "directory"), size=3)
    agents: dict[str, LocalAgent] = {}
    engines: dict[str, GpuEngine] = {}
    daemon_b: AgentDaemon | None = None
    try:
        cluster.start(timeout_s=60)
        spec = pool_spec(shape, pool_slots)
        agents["a"] = LocalAgent("a", base, cluster.grpc_addresses, spec, "tcp,shm,cuda",
                                 lease_ms=LEASE_MS)  # fmt: skip
        agents["c"] = LocalAgent("c", base, cluster.grpc_addresses, spec, "tcp,cuda",
                                 lease_ms=LEASE_MS, host=OTHER_HOST)  # fmt: skip
        for a in agents.values():
            a.launch(timeout_s=60)
        daemon_b = _daemon_b(cluster, base, shape, pool_slots)
        daemon_b.start()
        sockets = {
            "a": agents["a"].engine_socket,
            "b": daemon_b.cfg.engine_socket,
            "c": agents["c"].engine_socket,
            "n": None,
        }
        for name, sock in sockets.items():
            ktc = kvdir_config(sock) if sock else None
            e = gpu_engine(name, base, model_dir, shape, max_len, ktc, memory_share, extra)
            engines[name] = e
            e.launch()
            e.wait_started()
            print(f"==> engine {name} ready", flush=True)
        yield GpuNodes(shape, cluster, agents, daemon_b, engines)
    finally:
        for e in engines.values():
            e.stop()
        if daemon_b is not None:
            with contextlib.suppress(Exception):
                daemon_b.stop(deregister=False)
        for a in agents.values():
            a.stop()
        cluster.stop()
