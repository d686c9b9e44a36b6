"""The GPU bench's two-engine cluster, for a shape of which four engines do not fit on
one GPU (the Llama-3-70B shape cut to 20 layers: ~36 GiB of bf16 weights per engine):

    a  engine + agent a (tcp, shm, cuda)   computes and saves every prefix (the holder);
                                           after a GPU prefix-cache reset its own pool
                                           serves it back (the peer table's kvdir row)
    b  engine + agent b (tcp, shm, cuda)   pulls a's prefixes over CUDA IPC (same host);
                                           its own recompute (a fresh cache_salt) and its
                                           local hit are the baselines
    o  engine with vLLM's own OffloadingConnector (its CPU tier, no agent): the peer,
       started once b has stopped (three engines of this shape do not fit)

A 3-replica directory on 127.0.0.1. Engines start one after another, each once the
GPU has the memory free that it will ask for (vLLM refuses to start otherwise, and a
stopped engine's memory comes back only after its processes are gone).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.vllm.gpu_nodes import (
    LEASE_MS,
    GpuEngine,
    GpuShape,
    gpu_engine,
    kvdir_config,
    pool_spec,
)
from kvdir.local import LocalAgent, LocalCluster, wait_for

PAIR_START_TIMEOUT_S = 300.0
"""One engine of the 70B shape starts in ~45 s alone on the H200."""
GPU_FREE_TIMEOUT_S = 60.0
GPU_FREE_MARGIN_BYTES = 1 << 30
"""The new process's own CUDA context comes out of the free memory vLLM sees."""
PEER_CPU_BYTES = 8 << 30
"""vLLM's CPU tier on o: twelve 8k-token prompts of the 70B shape (640 MiB each)."""
PEER_CONNECTOR = "OffloadingConnector"


def offload_config(cpu_bytes: int) -> dict[str, Any]:
    """vLLM 0.24's in-tree CPU offloading connector as `--kv-offloading-size` configures
    it (the "native" backend: CPUOffloadingSpec, LRU, offloaded blocks of the GPU's
    block size); prompt blocks only (its default)."""
    return {
        "kv_connector": PEER_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }


def wait_gpu_free(share: float, timeout_s: float = GPU_FREE_TIMEOUT_S) -> None:
    """Wait until `share` of the GPU's memory (and a context's worth) is free."""
    import torch

    def enough() -> bool:
        free, total = torch.cuda.mem_get_info()
        return bool(free >= share * total + GPU_FREE_MARGIN_BYTES)

    wait_for(enough, timeout_s, f"{share:.2f} of the GPU's memory to be free", 0.2)


def drop_pools(base: str) -> None:
    """Remove the agents' pool files under `base` (host copies in /dev/shm; the logs stay)."""
    for path in glob.glob(os.path.join(base, "**", "kvdir-*-pool*"), recursive=True):
        with contextlib.suppress(OSError):
            os.remove(path)


@dataclass
class PairNodes:
    shape: GpuShape
    base: str
    model_dir: str
    max_len: int
    memory_share: float
    cluster: LocalCluster
    agents: dict[str, LocalAgent]
    engines: dict[str, GpuEngine] = field(default_factory=dict)

    def socket(self, name: str) -> str:
        return self.agents[name].engine_socket

    def start(self, name: str, ktc: dict[str, Any] | None) -> GpuEngine:
        """Start engine `name` with kv_transfer_config `ktc` and wait until it is ready."""
        wait_gpu_free(self.memory_share)
        e = gpu_engine(
            name, self.base, self.model_dir, self.shape, self.max_len, ktc, self.memory_share
        )
        e.start_timeout_s = PAIR_START_TIMEOUT_S
        self.engines[name] = e  # stopped on the way out even if it never answers
        e.launch()
        e.wait_started()
        print(f"==> engine {name} ready ({self.shape.name})", flush=True)
        return e

    def start_kvdir(self, name: str) -> GpuEngine:
        return self.start(name, kvdir_config(self.socket(name)))

    def start_peer(self) -> GpuEngine:
        return self.start("o", offload_config(PEER_CPU_BYTES))

    def stop(self, name: str) -> None:
        """Stop engine `name` and every process of its group (its GPU memory comes back)."""
        e = self.engines.pop(name, None)
        if e is not None:
            e.stop()


@contextlib.contextmanager
def pair_nodes(
    work: str, shape: GpuShape, max_len: int, pool_slots: int, memory_share: float,
    agents: tuple[str, ...],
) -> Iterator[PairNodes]:  # fmt: skip
    """A directory and agents `agents` (their engines are started by the caller). A
    fresh folder under `work`: a kept work dir's earlier Raft journals stay out of it."""
    base = tempfile.mkdtemp(prefix="pair-", dir=work)  # unix socket paths stay short
    model_dir = shape.write(os.path.join(base, "model"), max_len)
    cluster = LocalCluster(os.path.join(base, "directory"), size=3)
    started: dict[str, LocalAgent] = {}
    n: PairNodes | None = None
    try:
        cluster.start(timeout_s=60)
        spec = pool_spec(shape, pool_slots)
        for name in agents:
            started[name] = LocalAgent(
                name, base, cluster.grpc_addresses, spec, "tcp,shm,cuda", lease_ms=LEASE_MS
            )
            started[name].launch(timeout_s=60)
        n = PairNodes(shape, base, model_dir, max_len, memory_share, cluster, started)
        yield n
    finally:
        if n is not None:
            for name in list(n.engines):
                n.stop(name)
        for a in started.values():
            a.stop()
        cluster.stop()
        drop_pools(base)
