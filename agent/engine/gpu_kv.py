"""Worker side of the GPU path: vLLM's KV blocks <-> this node's GPU tier, batched.

What a connector worker calls when its agent's pool for the namespace is GPU
tier (agent/gpu_pool.py). It takes vLLM's per-layer FlashAttention caches
``[2, num_blocks, block_size, heads, head_dim]`` and block ids, and moves
whole blocks with one kernel per batch (transfer/cuda_blocks.py), never one
copy per segment:

- `load(slots, block_ids)`: GPU tier slots -> vLLM blocks, on a load stream
  that first waits for the work already queued on the engine's stream;
  returns an event (the forward that reads the blocks waits on it).
- `save(tag, block_ids, slots, hashes)`: vLLM blocks -> GPU tier slots, then
  the slots' host copies (what other hosts are served), on a side stream
  after the engine's queued work: the forward pass is not stalled. The slots
  are announced STORED only by `finished_saves`, once the copies completed,
  and only then may the engine reuse the source blocks (vLLM: the request's
  blocks stay allocated until the connector reports it finished sending).
- `validated(slots, hashes, generations)`: after a load landed, how many
  leading slots still hold what was expected (generation, STORED, hash), from
  the host-visible headers: the same seqlock check as the host path; the
  first mismatch ends the valid prefix and the rest is recomputed.

The tier is mapped in this process through the agent's cuda descriptor
(`EngineClient.device_transports`), the headers through the pool file the
engine library maps anyway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdir.agent.gpu_pool import pin_host, slot_runs
from kvdir.agent.pool import HEADER_BYTES, KvPool, valid_prefix
from kvdir.transfer.base import TransferError
from kvdir.transfer.cuda_blocks import (
    BlockCopier,
    external_stream,
    slot_planes,
    vllm_planes,
)
from kvdir.transfer.cuda_ipc import (
    CudaIpcChannel,
    CudaIpcTransport,
    cuda_errors,
    load_cupy,
    wait_event,
)
from kvdir.v1 import agent_pb2 as apb

_TO_HOST = 2
"""cudaMemcpyDeviceToHost."""
SAVES_PENDING_MAX = 4096
"""Saves in flight per worker; past this `save` refuses (the caller skips the save)."""


class GpuPathError(ValueError):
    """The GPU path cannot be used with these caches or this pool (the message says why)."""


@dataclass(frozen=True, slots=True)
class PendingSave:
    tag: str
    """The caller's name for the save (vLLM: the request id)."""
    hashes: tuple[bytes, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    done: Any


def map_tier(info: apb.PoolInfo, descriptor: dict[str, str], device: int) -> tuple[Any, int]:
    """(channel, pointer): the agent's GPU tier of `info`, mapped in this process."""
    if not info.gpu_rkey:
        raise GpuPathError("the agent's pool for this namespace is not GPU tier")
    channel: CudaIpcChannel = CudaIpcTransport().connect(descriptor)
    return channel, channel.device_pointer(info.gpu_rkey, device)


class GpuKvMover:
    """Batched block moves between vLLM's caches and one GPU-tier pool."""

    def __init__(
        self,
        layers: Sequence[Any],
        pool: KvPool,
        tier_pointer: int,
        device: int,
        streams: tuple[int, int] | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """`layers`: per-layer torch caches of `num_blocks` blocks; `pool`: the
        engine's mapping of the pool file (headers, host copies); `tier_pointer`:
        the GPU tier mapped here; `streams`: raw (load, save) CUDA streams
        (default: two new ones)."""
        try:
            self.vllm, self.segment_bytes = vllm_planes(layers, num_blocks)
        except ValueError as e:
            raise GpuPathError(f"kvdir GPU path: {e}") from e
        g = pool.geometry
        planes = self.vllm.planes
        self.block_bytes = planes * self.segment_bytes
        if self.block_bytes > g.slot_bytes:
            raise GpuPathError(
                f"kvdir GPU path: blocks of {self.block_bytes} B, pool slots of {g.slot_bytes} B"
            )
        self.pool = pool
        self.device = device
        self.tier = slot_planes(tier_pointer, g.slots, g.slot_bytes, planes, self.segment_bytes)
        self._tier_base = tier_pointer
        self.copier = BlockCopier(device)
        cp = self.cp = load_cupy()
        with cp.cuda.Device(device):
            self.host_pinned, _ = pin_host(cp, pool.base_address, g.size)
            if not self.host_pinned:
                raise GpuPathError(
                    "kvdir GPU path: the pool file could not be page-locked (cudaHostRegister); "
                    "saves stage host copies with the copy kernel, which needs it"
                )
            if streams is None:
                self._streams = tuple(cp.cuda.Stream(non_blocking=True) for _ in range(2))
                streams = (self._streams[0].ptr, self._streams[1].ptr)
        self.load_stream, self.save_stream = streams
        self._pending: list[PendingSave] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------- loads

    def load(self, slots: Sequence[int], block_ids: Sequence[int], after: int = 0) -> Any:
        """Tier `slots` -> vLLM `block_ids` (one kernel on the load stream, started
        after what is queued on stream `after`); returns the completion event."""
        self._after(self.load_stream, after)
        return self.copier.launch(
            self.tier, slots, self.vllm, block_ids, self.segment_bytes, self.load_stream
        )

    def wait(self, event: Any, timeout_s: float) -> None:
        """Until `event` (from load/save) completed; TransferError past the deadline."""
        if event is not None:
            wait_event(event, time.perf_counter() + timeout_s, "GPU KV copy")

    def headers(self, slots: Sequence[int]) -> bytes:
        """The current 64-byte headers of `slots`, concatenated (host memory)."""
        view, off = self.pool.view, self.pool.geometry.header_offset
        return b"".join(view[off + s * HEADER_BYTES : off + (s + 1) * HEADER_BYTES] for s in slots)

    def validated(
        self, slots: Sequence[int], hashes: Sequence[bytes], generations: Sequence[int]
    ) -> int:
        """Leading slots still STORED under `generations` with `hashes`, read now
        (call after the load's event completed: the seqlock's second read)."""
        return valid_prefix(self.headers(slots), hashes, generations)

    def generations(self, slots: Sequence[int]) -> list[int]:
        """The slots' generations now (the seqlock's first read, before a load)."""
        return self.pool.generations(slots)

    # ------------------------------------------------------------- saves

    def save(
        self,
        tag: str,
        block_ids: Sequence[int],
        slots: Sequence[int],
        hashes: Sequence[bytes],
        after: int = 0,
        hold: int | None = None,
    ) -> bool:
        """vLLM `block_ids` -> tier `slots` -> their host copies, on the side stream
        after what is queued on stream `after` (the forward that computed them).
        With `hold`, work queued on that stream from now on (the engine's next
        forwards, which may rewrite freed blocks) waits for the device-to-device
        read of the blocks only, never for the host copies. False (nothing
        queued) when SAVES_PENDING_MAX saves are in flight."""
        if not (len(block_ids) == len(slots) == len(hashes)):
            raise ValueError(f"{len(block_ids)} blocks, {len(slots)} slots, {len(hashes)} hashes")
        with self._lock:
            if len(self._pending) >= SAVES_PENDING_MAX:
                return False
        if not slots:
            return True
        self._after(self.save_stream, after)
        s = self.save_stream
        read = self.copier.launch(self.vllm, block_ids, self.tier, slots, self.segment_bytes, s)
        if hold is not None:
            external_stream(self.cp, hold).wait_event(read)
        done = self._stage(slots, s)
        with self._lock:
            self._pending.append(
                PendingSave(tag, tuple(hashes), tuple(slots), tuple(block_ids), done)
            )
        return True

    def stage_host(self, tag: str, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Tier `slots` -> their host copies on the side stream (blocks that reached
        the tier by CUDA IPC: other hosts read the host copy). Announce them
        stored only once `finished_saves` returns them."""
        if not slots:
            return
        s = self.save_stream
        done = self._stage(slots, s)
        with self._lock:
            self._pending.append(PendingSave(tag, tuple(hashes), tuple(slots), (), done))

    def _stage(self, slots: Sequence[int], stream: int) -> Any:
        """Tier `slots` -> their host copies on `stream`, by the GPU's copy engines: one
        cudaMemcpyAsync per run of consecutive slots (slot s sits at the same offset in
        both). Not the copy kernel: a kernel writing host memory holds its SMs for as
        long as PCIe takes (~20 ms for 1 GiB), and the forward passes running beside
        it lose them (on the H200 a pull's first forward at 8k tokens ran ~7 ms slower
        than a local hit's, bench/results/vllm-gpu-2026-12-05-b.md). Returns an event
        recorded after the last copy."""
        g = self.pool.geometry
        runs = slot_runs(slots, g.slots)
        cp, sb, host = self.cp, g.slot_bytes, self.pool.data_address
        try:
            with cp.cuda.Device(self.device):
                for a, b in runs:
                    cp.cuda.runtime.memcpyAsync(
                        host + a * sb, self._tier_base + a * sb, (b - a) * sb, _TO_HOST, stream
                    )
                done = cp.cuda.Event(disable_timing=True)
                done.record(external_stream(cp, stream))
        except cuda_errors(cp) as e:
            raise TransferError(f"staging host copies failed: {e}") from e
        return done

    def finished_saves(self) -> list[PendingSave]:
        """Saves whose copies completed, in submission order (announce them stored;
        their source blocks may be reused from now on)."""
        with self._lock:
            k = 0
            while k < len(self._pending) and self._pending[k].done.done:
                k += 1
            out, self._pending = self._pending[:k], self._pending[k:]
        return out

    @property
    def saves_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def _after(self, stream: int, after: int) -> None:
        """Make `stream` wait for the work queued on stream `after` so far."""
        ev = self.copier.event(after)
        external_stream(self.cp, stream).wait_event(ev)


def block_digest(layers: Sequence[Any], block_ids: Sequence[int]) -> list[str]:
    """sha256 of each block's bytes over every layer (tests: byte-identical checks)."""
    import hashlib

    import torch

    out = []
    for b in block_ids:
        h = hashlib.sha256()
        for t in layers:
            h.update(t[:, b].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return out
