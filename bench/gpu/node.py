"""One experiment "node": an engine process with a GPU paged KV cache and a kvdir pool.

Started by `bench.gpu.experiment` (two of them: node A and node B), driven by
one JSON object per line on stdin, answering one JSON object per line on
stdout (logs go to stderr). What a node holds:

- the engine (`bench.gpu.model`), its paged KV cache on its GPU, registered
  with kvdir's `cuda` transport together with its `PagedLayout`;
- a kvdir `KvPool` file (agent/pool.py): slot i's 64-byte header carries the
  generation and hash of GPU block i (the truth readers validate against),
  and slot i's data is GPU block i staged to host memory (block-major; what
  the TCP path serves), registered with the `tcp` and `shm` transports;
- block ids are pool slots, handed out by `KvPool.allocate` from a free list
  shuffled at start, as in an engine that has run for a while (so fetched
  blocks are scattered on both sides and nothing coalesces by luck).

The holder's metadata (block ids, generations, hashes, transport
descriptors) reaches the reader through the driver, standing in for the
directory lookup and the agents' handshake (which need no GPU and are
measured elsewhere: docs/directory.md, docs/agent.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.gpu.model import SHAPES, Engine, PagedKvCache
from kvdir.agent.pool import HEADER_BYTES, KvPool, valid_prefix
from kvdir.transfer.base import Read
from kvdir.transfer.cuda_ipc import CudaIpcChannel, GpuBuffer, bare_copy
from kvdir.transfer.engine import Descriptor, TransferEngine
from kvdir.transfer.paged import PagedLayout

FETCH_TIMEOUT_S = 60.0


def log(msg: str) -> None:
    print(f"[{os.environ.get('KVDIR_NODE', '?')}] {msg}", file=sys.stderr, flush=True)


def conversation(conv: int, n: int, vocab: int) -> torch.Tensor:
    """Token ids of conversation `conv` (the same on every node)."""
    g = torch.Generator().manual_seed(1000 + conv)
    return torch.randint(0, vocab, (n,), generator=g)


def chain_hashes(tokens: torch.Tensor, block_size: int) -> list[bytes]:
    """Prefix-chained hash of each full block (equal hashes = reusable prefix)."""
    out, prev = [], b""
    arr = tokens.numpy().astype(np.int64)
    for i in range(len(arr) // block_size):
        prev = hashlib.blake2b(
            prev + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        out.append(prev)
    return out


def with_arrays(held: dict[str, Any]) -> dict[str, Any]:
    """The holder's announcement as the arrays a directory lookup would return (block
    ids, generations, hashes), converted once, outside the timed fetch."""
    return {
        **held,
        "blocks_np": np.asarray(held["blocks"], dtype=np.int64),
        "gens_np": np.asarray(held["generations"], dtype=np.uint64),
        "hash_bytes": [bytes.fromhex(h) for h in held["hashes"]],
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Node:
    def __init__(self, a: argparse.Namespace) -> None:
        shape = SHAPES[a.shape]
        self.shape = shape.with_layers(a.layers or shape.layers)
        # --gpu -1: a CPU dry run of everything but the cuda path (bench/gpu/README)
        self.gpu = a.gpu >= 0
        if self.gpu:
            torch.cuda.set_device(a.gpu)
            import cupy as cp

            cp.cuda.Device(a.gpu).use()  # CuPy's current device too (the cuda transport)
        self.device = torch.device("cuda", a.gpu) if self.gpu else torch.device("cpu")
        self.block_size = a.block_size
        t0 = time.perf_counter()
        self.engine = Engine(self.shape, self.device, seed=a.seed)
        self.cache = PagedKvCache(self.shape, a.blocks, a.block_size, self.device)
        sync()
        log(f"weights and cache ready in {time.perf_counter() - t0:.1f} s")
        path = os.path.join(a.pool_dir, f"kvdir-gpu-exp-{a.name}-{os.getpid()}")
        self.pool = KvPool.open(path, f"exp/{self.shape.name}", self.cache.block_bytes, a.blocks)
        # Fragment the free list: allocate everything, free it in random order.
        every = [s for s, _ in self.pool.allocate(a.blocks)]
        random.Random(a.seed * 7919 + sum(a.name.encode())).shuffle(every)
        self.pool.free(every)
        self.pinned = self._pin() if self.gpu else False
        backends = ["tcp", "shm", "cuda"] if self.gpu else ["tcp", "shm"]
        self.xfer = TransferEngine(backends, shared=[self.pool.mem])
        self.host_region = self.xfer.register(self.pool.view)
        self.layout = PagedLayout.contiguous(self.shape.layers, a.blocks, self.cache.segment_bytes)
        self.gpu_region = (
            self.xfer.register_device(self.cache.tensor, self.layout)
            if self.gpu
            else self.host_region
        )
        self.dst_buf = GpuBuffer.of(self.cache.tensor) if self.gpu else None
        self.reference: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self.held: dict[int, list[tuple[int, int]]] = {}  # conv -> (slot, generation)
        self.peer: dict[str, Any] = {}
        self.snapshot: torch.Tensor | None = None
        self.kv_chunked: torch.Tensor | None = None

    def _pin(self) -> bool:
        """Page-lock the pool mapping (cudaHostRegister) so host<->GPU copies DMA at
        full speed, as an engine that registers its host pool with CUDA would."""
        import cupy as cp

        base = self.pool.base_address
        try:
            cp.cuda.runtime.hostRegister(base, self.pool.geometry.size, 0)
        except cp.cuda.runtime.CUDARuntimeError as e:
            log(f"cudaHostRegister failed ({e}); host copies will be pageable")
            return False
        return True

    def hello(self) -> dict[str, Any]:
        return {
            "descriptors": [{"name": d.name, "params": d.params} for d in self.xfer.descriptors()],
            "host_rkey": self.host_region.rkey,
            "gpu_rkey": self.gpu_region.rkey,
            "gpu_address": self.gpu_region.address,
            "data_offset": self.pool.geometry.data_offset,
            "header_offset": self.pool.geometry.header_offset,
            "host_address": self.pool.base_address,
            "block_bytes": self.cache.block_bytes,
            "segment_bytes": self.cache.segment_bytes,
            "layers": self.shape.layers,
            "full_layers": self.shape.full_layers,
            "pinned": self.pinned,
            "gpu": torch.cuda.get_device_name(self.device) if self.gpu else "cpu (dry run)",
            "torch": torch.__version__,
        }

    # ------------------------------------------------------------------ holder

    def turn1(self, conv: int, n: int) -> dict[str, Any]:
        """Prefill turn 1 (n tokens), announce its blocks, stage them to host."""
        tokens = conversation(conv, n, self.shape.vocab)
        blocks = self.pool.allocate(-(-n // self.block_size))
        table = torch.tensor([s for s, _ in blocks], device=self.device)
        sync()
        t0 = time.perf_counter()
        logits = self.engine.forward(self.cache, tokens.to(self.device), 0, table)
        first = int(logits.argmax().item())
        prefill_s = time.perf_counter() - t0
        hashes = chain_hashes(tokens, self.block_size)
        full = blocks[: len(hashes)]
        # The KV is on the GPU (synchronized above) before any header says STORED.
        for (slot, gen), h in zip(full, hashes, strict=True):
            assert self.pool.mark_stored(slot, h, gen)
        t1 = time.perf_counter()
        staged = self.cache.gather_blocks(table[: len(full)]).view(len(full), -1)
        for i, (slot, _) in enumerate(full):
            host = torch.frombuffer(self.pool.slot_view(slot), dtype=torch.uint8)
            host.copy_(staged[i].view(torch.uint8), non_blocking=True)
        sync()
        offload_s = time.perf_counter() - t1
        del staged
        self.held[conv] = blocks
        return {
            "prefill_s": prefill_s,
            "offload_s": offload_s,
            "first_token": first,
            "blocks": [s for s, _ in full],
            "generations": [g for _, g in full],
            "hashes": [h.hex() for h in hashes],
        }

    def evict(self, conv: int, index: int) -> dict[str, Any]:
        slot, _ = self.held[conv][index]
        return {"slot": slot, "generation": self.pool.evict(slot)}

    def release(self, conv: int) -> dict[str, Any]:
        blocks = self.held.pop(conv, [])
        self.pool.free([s for s, _ in blocks])
        return {"freed": len(blocks)}

    # ------------------------------------------------------------------ reader

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        self.peer = peer
        offered = [Descriptor(d["name"], d["params"]) for d in peer["descriptors"]]
        name, self.headers_ch = self.xfer.open_channel(offered)  # shm: same host
        _, self.tcp_ch = self.xfer.open_channel([d for d in offered if d.name == "tcp"])
        if not self.gpu:
            return {"headers_via": name}
        ch = self.xfer.open_device_channel(offered)
        assert isinstance(ch, CudaIpcChannel)
        self.cuda_ch = ch
        layout = ch.layout(peer["gpu_rkey"])
        assert layout is not None, "the holder published no layout"
        self.peer_layout = layout
        return {"headers_via": name}

    def _validate(self, held: dict[str, Any], n: int) -> int:
        """Read the holder's headers after the data; count the valid leading blocks.

        One read of the header span that covers the blocks (a few KiB to ~70 KiB)
        beats one 64-byte read per block; validation is vectorized (valid_prefix).
        """
        p = self.peer
        slots = held["blocks_np"][:n]
        lo, hi = int(slots.min()), int(slots.max())
        span = bytearray((hi - lo + 1) * HEADER_BYTES)
        start = p["host_address"] + p["header_offset"] + lo * HEADER_BYTES
        self.headers_ch.read([Read(start, p["host_rkey"], len(span), 0)], memoryview(span), 5.0)
        rows = np.frombuffer(span, np.uint8).reshape(-1, HEADER_BYTES)[slots - lo]
        return valid_prefix(rows.tobytes(), held["hash_bytes"][:n], held["gens_np"][:n])

    def _fetch_tcp(self, held: dict[str, Any], dst: list[int]) -> tuple[int, int]:
        p, n = self.peer, len(dst)
        bb = p["block_bytes"]
        reads = [
            Read(
                p["host_address"] + p["data_offset"] + slot * bb,
                p["host_rkey"],
                bb,
                self.pool.data_offset(d),
            )
            for slot, d in zip(held["blocks"], dst, strict=True)
        ]
        moved = self.tcp_ch.read(reads, self.pool.view, FETCH_TIMEOUT_S)
        valid = self._validate(held, n)
        staging = torch.empty((valid, bb), dtype=torch.uint8, device=self.device)
        for i in range(valid):
            host = torch.frombuffer(self.pool.slot_view(dst[i]), dtype=torch.uint8)
            staging[i].copy_(host, non_blocking=True)
        s = self.shape
        shaped = staging.view(torch.bfloat16).view(
            valid, s.layers, 2, self.block_size, s.kv_heads, s.head_dim
        )
        self.cache.scatter_blocks(torch.tensor(dst[:valid], device=self.device), shaped)
        return valid, moved

    def _fetch_cuda(self, held: dict[str, Any], dst: list[int]) -> tuple[int, int]:
        moved = self.cuda_ch.read_blocks(
            self.peer["gpu_rkey"],
            held["blocks_np"][: len(dst)],
            self.dst_buf,
            self.layout,
            np.asarray(dst, dtype=np.int64),
            FETCH_TIMEOUT_S,
        )
        return self._validate(held, len(dst)), moved

    def turn2(
        self, conv: int, n: int, new: int, held: dict[str, Any], modes: list[str], reps: int
    ) -> dict[str, Any]:
        """Time to first token of turn 2 (n context + `new` tokens) per mode."""
        tokens = conversation(conv, n + new, self.shape.vocab).to(self.device)
        held = with_arrays(held)
        blocks = self.pool.allocate(-(-(n + new) // self.block_size))
        dst_all = [s for s, _ in blocks]
        table = torch.tensor(dst_all, device=self.device)
        nb = len(held["blocks"])
        dst = dst_all[:nb]
        out: dict[str, Any] = {"blocks": nb, "bytes": nb * self.cache.block_bytes}
        self.snapshot = None
        self.kv_chunked = None
        try:
            for mode in modes:
                out[mode] = self._mode(mode, tokens, n, held, table, dst, reps)
            if self.gpu:
                out["bare_copy"] = self._bare_copy(nb * self.cache.block_bytes, reps)
        finally:
            self.pool.free(dst_all)
        return out

    def _mode(
        self,
        mode: str,
        tokens: torch.Tensor,
        n: int,
        held: dict[str, Any],
        table: torch.Tensor,
        dst: list[int],
        reps: int,
    ) -> dict[str, Any]:
        key = (int(tokens[0]), n, len(tokens))
        ttft, fetch, prefill, firsts, opened_before = [], [], [], [], None
        if mode == "cuda":
            opened_before = self.xfer_handles()
        for rep in range(reps + 1):  # rep 0: warm-up (handle open, kernel build, caches)
            self.cache.tensor[:, :, table] = 0  # forget whatever an earlier mode left
            sync()
            t0 = time.perf_counter()
            valid, moved = 0, 0
            if mode == "tcp":
                valid, moved = self._fetch_tcp(held, dst)
            elif mode == "cuda":
                valid, moved = self._fetch_cuda(held, dst)
            elif mode == "chunked":
                # B computes the same prefix itself, then the rest: the KV a fetch
                # must reproduce exactly (same weights, kernels and shapes as A's).
                self.engine.forward(self.cache, tokens[: len(dst) * self.block_size], 0, table)
                valid = len(dst)
            t1 = time.perf_counter()
            start = valid * self.block_size
            logits = self.engine.forward(self.cache, tokens[start:], start, table)
            first = int(logits.argmax().item())
            t2 = time.perf_counter()
            if rep == 0:
                cold = {"ttft_s": t2 - t0, "fetch_s": t1 - t0}
                continue
            ttft.append(t2 - t0)
            fetch.append(t1 - t0)
            prefill.append(t2 - t1)
            firsts.append(first)
        res: dict[str, Any] = {
            "ttft_s": float(np.median(ttft)),
            "ttft_all_s": ttft,
            "fetch_s": float(np.median(fetch)),
            "prefill_rest_s": float(np.median(prefill)),
            "valid_blocks": valid,
            "bytes": moved,
            "cold": cold,
            "first_tokens": sorted(set(firsts)),
        }
        if mode in ("recompute", "chunked"):
            self.reference[(mode, *key)] = logits
        if mode != "recompute":
            ref = self.reference.get(("recompute", *key))
            if ref is not None:
                d = (logits - ref).abs()
                res["logits_max_abs_diff"] = float(d.max())
                res["logits_ref_max_abs"] = float(ref.abs().max())
                res["logits_cosine"] = float(
                    torch.nn.functional.cosine_similarity(logits, ref, dim=0)
                )
                res["argmax_equal"] = int(logits.argmax()) == int(ref.argmax())
                res["top5_overlap"] = len(
                    set(logits.topk(5).indices.tolist()) & set(ref.topk(5).indices.tolist())
                )
            kv = self.cache.tensor[:, :, table[: len(dst)]].clone()
            if mode == "chunked":
                self.kv_chunked = kv
            else:
                chunked = self.reference.get(("chunked", *key))
                if chunked is not None and self.kv_chunked is not None:
                    res["logits_equal_chunked"] = bool(torch.equal(logits, chunked))
                    res["logits_max_abs_diff_chunked"] = float((logits - chunked).abs().max())
                    res["kv_equal_chunked"] = bool(torch.equal(kv, self.kv_chunked))
                if self.snapshot is None:
                    self.snapshot = kv
                else:
                    res["kv_bitwise_equal_to_previous_mode"] = bool(torch.equal(kv, self.snapshot))
                    self.snapshot = None
        if mode == "cuda":
            res["ipc_opens"] = self.xfer_handles() - (opened_before or 0)
            res["ipc_open_s"] = self._cuda().handles.open_seconds
            res["segments"] = len(dst) * 2 * self.shape.layers
        return res

    def _cuda(self) -> Any:
        return self.xfer.transports["cuda"]

    def xfer_handles(self) -> int:
        return int(self._cuda().handles.opened)

    def _bare_copy(self, nbytes: int, reps: int) -> dict[str, Any]:
        """One cudaMemcpy of the same bytes from the holder's (IPC-mapped) region,
        and the same copy local to this process: the baselines of the cuda read."""
        cp = self._cuda().cp
        dev = self.device.index
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        local = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        src = self.cuda_ch.device_pointer(self.peer["gpu_rkey"], dev)
        out: dict[str, Any] = {}
        for name, s in (("ipc", src), ("local", local.data_ptr())):
            times = []
            for rep in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                bare_copy(cp, dev, scratch.data_ptr(), s, nbytes)
                sync()
                if rep:
                    times.append(time.perf_counter() - t0)
            out[f"{name}_s"] = float(np.median(times))
        return out

    def fetch_only(self, held: dict[str, Any], reps: int) -> dict[str, Any]:
        """The cuda read of `held` alone: the paged-block kernel (what the fetch uses)
        and the generic segment-list kernel; wall time and GPU time (CUDA events)."""
        held = with_arrays(held)
        nb = len(held["blocks"])
        blocks = self.pool.allocate(nb)
        dst = [s for s, _ in blocks]
        p = self.peer
        dst_np = np.asarray(dst, dtype=np.int64)
        out: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            batch = self.peer_layout.segments(
                p["gpu_rkey"], p["gpu_address"], held["blocks"], self.layout, dst
            )
            out["batch_build_s"] = time.perf_counter() - t0
            out["segments"] = len(batch)
            out["pieces"] = len(batch.coalesce().split(1 << 16))

            def blocks_read() -> None:
                self.cuda_ch.read_blocks(
                    p["gpu_rkey"], held["blocks_np"], self.dst_buf, self.layout, dst_np, 60.0
                )

            def segments_read() -> None:
                b = self.peer_layout.segments(
                    p["gpu_rkey"], p["gpu_address"], held["blocks"], self.layout, dst
                )
                self.cuda_ch.read_batch(b, self.cache.tensor, 60.0)

            event: Any = torch.cuda.Event  # untyped in torch's stubs
            for name, fn in (("read", blocks_read), ("segments_read", segments_read)):
                wall, gpu = [], []
                for rep in range(reps + 1):
                    sync()
                    e0, e1 = event(enable_timing=True), event(enable_timing=True)
                    e0.record()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    e1.record()
                    e1.synchronize()
                    if rep:
                        wall.append(t1 - t0)
                        gpu.append(e0.elapsed_time(e1) / 1e3)
                out[f"{name}_s"] = float(np.median(wall))
                out[f"{name}_gpu_s"] = float(np.median(gpu))
            # Where the read's time goes: host work up to the launch, the kernel alone
            # (CUDA events around it), and the same kernel on this process's own memory
            # (no IPC mapping) between the same block ids.
            self.cuda_ch.profile = True
            host, kern = [], []
            for rep in range(reps + 1):
                sync()
                blocks_read()
                if rep:
                    host.append(self.cuda_ch.last_host_s)
                    kern.append(self.cuda_ch.last_kernel_s)
            self.cuda_ch.profile = False
            out["read_host_s"] = float(np.median(host))
            out["read_kernel_s"] = float(np.median(kern))
            own = self.xfer.open_device_channel(
                [Descriptor(d.name, d.params) for d in self.xfer.descriptors()]
            )
            assert isinstance(own, CudaIpcChannel)
            own.profile = True
            spare = held["blocks_np"] % self.layout.blocks  # any valid blocks of our own
            local = []
            for rep in range(reps + 1):
                sync()
                own.read_blocks(
                    self.gpu_region.rkey, spare, self.dst_buf, self.layout, dst_np, 60.0
                )
                if rep:
                    local.append(own.last_kernel_s)
            own.close()
            out["local_kernel_s"] = float(np.median(local))
            return out
        finally:
            self.pool.free(dst)

    def invalidation(self, held: dict[str, Any], evicted: int) -> dict[str, Any]:
        """After the holder evicted block `evicted`, a fetch must stop there."""
        held = with_arrays(held)
        nb = len(held["blocks"])
        blocks = self.pool.allocate(nb)
        dst = [s for s, _ in blocks]
        try:
            fetch = self._fetch_cuda if self.gpu else self._fetch_tcp
            valid, _ = fetch(held, dst)
        finally:
            self.pool.free(dst)
        return {"valid_blocks": valid, "expected": evicted, "passed": valid == evicted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-dir", default="/dev/shm")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ["KVDIR_NODE"] = a.name
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns the real stdout
    node = Node(a)

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ok": True, **node.hello()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                break
            res = getattr(node, op)(**cmd)
            reply({"ok": True, **res})
        except Exception as e:
            log(f"{op} failed: {type(e).__name__}: {e}")
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    node.xfer.close()
    node.pool.close(unlink=True)


if __name__ == "__main__":
    main()
