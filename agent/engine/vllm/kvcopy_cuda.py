"""Worker side on CUDA: vLLM's GPU KV blocks <-> the agent's GPU tier, batched, off the forward.

A CUDA engine's pool must be GPU tier (``tier = "gpu"`` in the agent's
[[pools]]): its slots live in the agent's device memory, mapped here over
CUDA IPC, with each slot's header and host copy in the pool file the engine
maps anyway (agent/gpu_pool.py). Every move is one kernel for every layer and
every block of the batch (agent/engine/gpu_kv.py over transfer/cuda_blocks.py),
following the caches' real strides (transfer/kv_layout.py):

- load: tier slots -> vLLM blocks on a load stream; returns once the bytes
  landed (the caller validates headers afterwards, and vLLM schedules the
  request only after the connector reports the load finished);
- save: vLLM blocks -> tier slots -> host copies on a save stream that waits
  for the forward that computed them. The engine's stream waits for the
  device-to-device read only (so a later forward cannot rewrite a freed block
  before it was read) and never for the host copies. Slots are announced
  stored only once both copies completed (`completed`);
- blocks a same-host peer's tier gave us over CUDA IPC reach the tier only:
  their host copies are staged the same way before they are announced, so a
  reader on another host never gets a stale host copy.

A host-tier pool behind a CUDA engine is refused at start: its bytes would
cross PCIe on the engine's critical path, and the GPU tier is what makes the
same-host path device-to-device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvdir.agent.engine.gpu_kv import GpuKvMover, GpuPathError, map_tier
from kvdir.agent.engine.vllm.namespace import KvShape, NamespaceError
from kvdir.agent.engine.vllm.seam import AgentSeam
from kvdir.transfer.kv_layout import LayoutError, cache_layout

CUDA_TRANSPORT = "cuda"
"""The transport name a fetch reports when it read a same-host peer's GPU tier."""


def check_caches(layers: Sequence[torch.Tensor], shape: KvShape, num_blocks: int) -> None:
    """The registered caches are what the namespace promised (order, token dims, dtype)."""
    first = layers[0]
    try:
        got = cache_layout(tuple(first.shape), tuple(first.stride()), num_blocks)
    except LayoutError as e:
        raise NamespaceError(f"kvdir connector: {e}") from e
    want = (2, *got.token_shape)
    if got.order.lower() != shape.order or want != shape.block_shape:
        raise NamespaceError(
            f"kvdir connector: vLLM's KV caches are laid out {got.order} {want}, the "
            f"namespace promised {shape.order.upper()} {shape.block_shape} (is "
            f"VLLM_KV_CACHE_LAYOUT the same in every vLLM process?)"
        )
    if len(layers) != shape.layers:
        raise NamespaceError(f"kvdir connector: {len(layers)} layers, expected {shape.layers}")


class CudaCopier:
    """The worker's mover for one CUDA engine and its agent's GPU-tier pool."""

    def __init__(
        self, layers: Sequence[torch.Tensor], shape: KvShape, seam: AgentSeam, num_blocks: int
    ) -> None:
        self.shape = shape
        client = seam.attach()
        attached = seam.attached_pool()
        info = attached.info
        if not info.gpu_rkey:
            raise NamespaceError(
                'kvdir connector: a CUDA engine needs a GPU-tier pool (tier = "gpu" in the '
                "agent's [[pools]] entry for this namespace); this one is host tier"
            )
        descriptor = client.device_transports.get(CUDA_TRANSPORT)
        if descriptor is None:
            raise NamespaceError(
                "kvdir connector: the agent offers no cuda transport (add cuda to its transports)"
            )
        device = layers[0].device.index or 0
        try:
            self._channel, pointer = map_tier(info, descriptor, device)
            self.mover = GpuKvMover(layers, attached.pool, pointer, device, num_blocks=num_blocks)
        except (GpuPathError, ValueError) as e:
            raise NamespaceError(f"kvdir connector: {e}") from e
        self.device = device
        self._ready: list[tuple[tuple[bytes, ...], tuple[int, ...]]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _engine_stream() -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def from_pool(self, slots: Sequence[int], block_ids: Sequence[int], stream: int = 0) -> None:
        """Tier `slots` -> vLLM `block_ids`, after the work queued on `stream` so far;
        returns once the bytes landed (no deadline: a copy that could complete
        after we gave up could overwrite what vLLM recomputed)."""
        if not slots:
            return
        event = self.mover.load(slots, block_ids, after=stream)
        if event is not None:
            event.synchronize()

    def to_pool(
        self, block_ids: Sequence[int], slots: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        """Queue a save after the engine's current forward; False: too many in flight."""
        s = self._engine_stream()
        return self.mover.save("save", block_ids, slots, hashes, after=s, hold=s)

    def fetched(self, slots: Sequence[int], hashes: Sequence[bytes], transport: str) -> None:
        """Blocks a fetch put in the tier: staged to their host copies first when
        they came over CUDA IPC (a host-path fetch wrote the host copy itself)."""
        if transport == CUDA_TRANSPORT:
            self.mover.stage_host("fetched", slots, hashes)
        else:
            with self._lock:
                self._ready.append((tuple(hashes), tuple(slots)))

    def completed(self) -> list[tuple[tuple[bytes, ...], tuple[int, ...]]]:
        """(hashes, slots) whose copies completed since the last call: announce them."""
        out = [(p.hashes, p.slots) for p in self.mover.finished_saves()]
        with self._lock:
            ready, self._ready = self._ready, []
        return ready + out

    @property
    def in_flight(self) -> int:
        return self.mover.saves_in_flight

    def close(self) -> None:
        self._channel = None
