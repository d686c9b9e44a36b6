"""One node's engine worker on the product GPU path (driven by bench.gpu.product).

The process holds what a vLLM worker with the kvdir connector holds: the
model's paged KV cache as vLLM's per-layer tensors ``[2, blocks, block_size,
heads, head_dim]`` (bench/gpu/model.py, real torch CUDA tensors), the engine
library attached to this node's agent (agent/engine/client.py), and the
worker's GPU mover (agent/engine/gpu_kv.py) over the agent's GPU tier. Everything
between nodes goes through the product: the agent publishes to the
directory, the reader's agent looks the chain up, picks the holder and path
(agent/holders.py), reads over CUDA IPC into its GPU tier and validates the
holder's headers; the worker then loads its tier slots into vLLM blocks.

Protocol: one JSON object per line on stdin, one answer per line on stdout
(as bench/gpu/node.py); logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch

from bench.gpu.model import SHAPES, Engine, PagedKvCache
from bench.gpu.node import chain_hashes, conversation
from kvdir.agent.engine.client import EngineClient
from kvdir.agent.engine.gpu_kv import GpuKvMover, block_digest, map_tier
from kvdir.core.client import namespace
from kvdir.core.wire import namespace_key
from kvdir.transfer.cuda_blocks import external_stream
from kvdir.transfer.cuda_ipc import bare_copy, load_cupy

WAIT_S = 60.0


def log(msg: str) -> None:
    print(f"[{os.environ.get('KVDIR_NODE', '?')}] {msg}", file=sys.stderr, flush=True)


def model_ns(shape: str) -> Any:
    return namespace(f"kvdir-gpu-{shape}", 16, "bf16", "vllm-flash")


def _ms(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else 0.0


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        shape = SHAPES[a.shape]
        self.shape = shape.with_layers(a.layers or shape.layers)
        torch.cuda.set_device(a.gpu)
        load_cupy().cuda.Device(a.gpu).use()
        self.device = torch.device("cuda", a.gpu)
        self.engine = Engine(self.shape, self.device, seed=a.seed)
        self.cache = PagedKvCache(self.shape, a.blocks, 16, self.device)
        self.layers = [self.cache.layer(i) for i in range(self.shape.layers)]
        self.ns = model_ns(a.shape)
        self.client = EngineClient(a.socket)
        attached = self.client.pools[namespace_key(self.ns)]
        self.tier_channel, ptr = map_tier(
            attached.info, self.client.device_transports["cuda"], a.gpu
        )
        self.pool = attached.pool
        self.mover = GpuKvMover(self.layers, self.pool, ptr, a.gpu)
        self.tier_pointer = ptr
        self.free_blocks = list(range(a.blocks))
        random.Random(a.seed + len(a.name)).shuffle(self.free_blocks)  # scattered blocks
        self.held: dict[int, dict[str, Any]] = {}
        torch.cuda.synchronize()

    def _stream(self) -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def _take(self, n: int) -> list[int]:
        out, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return out

    def hello(self) -> dict[str, Any]:
        return {
            "node": self.client.node_id,
            "block_bytes": self.mover.block_bytes,
            "layers": self.shape.layers,
            "full_layers": self.shape.full_layers,
            "gpu": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "host_pinned": bool(self.mover.host_pinned),
        }

    # ------------------------------------------------------------- holder (A)

    def turn1(self, conv: int, n: int) -> dict[str, Any]:
        """Prefill turn 1, save its full blocks through the GPU tier, announce them."""
        tokens = conversation(conv, n, self.shape.vocab).to(self.device)
        ids = self._take(-(-n // 16))
        table = torch.tensor(ids, device=self.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.engine.forward(self.cache, tokens, 0, table)
        hashes = chain_hashes(tokens.cpu(), 16)
        nb = len(hashes)
        slots = self.client.allocate(self.ns, nb).slots
        t1 = time.perf_counter()
        assert self.mover.save(f"conv{conv}", ids[:nb], slots, hashes, after=self._stream())
        t2 = time.perf_counter()  # the save is queued: the forward pass was not waited on
        done: list[Any] = []
        while not done:
            done = self.mover.finished_saves()
            if time.perf_counter() - t2 > WAIT_S:
                raise TimeoutError("save did not complete")
        t3 = time.perf_counter()
        for p in done:
            self.client.stored(self.ns, p.hashes, p.slots)
        self.client.flush()
        self.held[conv] = {"ids": ids, "slots": slots, "hashes": hashes}
        return {
            "prefill_and_queue_s": t1 - t0,
            "save_call_s": t2 - t1,
            "save_done_s": t3 - t1,
            "hashes": [h.hex() for h in hashes],
            "digests": block_digest(self.layers, ids[:nb]),
            "slots": slots,
        }

    def reuse(self, conv: int, index: int) -> dict[str, Any]:
        """Rewrite slot `index` of `conv` the way an engine reuses a block: the
        generation is bumped first (header), then the GPU bytes change; the
        directory is not told yet (its record is what a racing reader looks up)."""
        slot = self.held[conv]["slots"][index]
        gen = self.pool.evict(slot)
        cp = load_cupy()
        g = self.pool.geometry
        cp.cuda.runtime.memset(self.tier_pointer + slot * g.slot_bytes, 0xAB, g.slot_bytes)
        cp.cuda.runtime.deviceSynchronize()
        return {"slot": slot, "generation": gen}

    def release(self, conv: int) -> dict[str, Any]:
        h = self.held.pop(conv)
        freed = self.client.free(self.ns, h["slots"])
        self.free_blocks += h["ids"]
        return {"freed": freed}

    # ------------------------------------------------------------- reader (B)

    def peek(self, hashes: list[str]) -> dict[str, Any]:
        """The longest prefix a peer holds (what the connector's scheduler asks)."""
        found = self.client.lookup(self.ns, [bytes.fromhex(h) for h in hashes])
        return {"peer_blocks": max((p.prefix_blocks for p in found.peers), default=0)}

    def fetch_once(self, hashes: list[bytes], ids: list[int]) -> dict[str, Any]:
        """The connector's remote load: lookup, reserve, Fetch (agent), load, validate."""
        t0 = time.perf_counter()
        found = self.client.lookup(self.ns, hashes)
        t1 = time.perf_counter()
        slots = self.client.allocate(self.ns, len(hashes)).slots
        t2 = time.perf_counter()
        r = self.client.fetch(self.ns, hashes, slots, timeout_ms=int(WAIT_S * 1000))
        t3 = time.perf_counter()
        v = r.valid_blocks
        ev = self.mover.load(slots[:v], ids[:v], after=self._stream())
        self.mover.wait(ev, WAIT_S)
        t4 = time.perf_counter()
        return {
            "peer_blocks": max((p.prefix_blocks for p in found.peers), default=0),
            "valid": v,
            "invalidated": r.invalidated,
            "transport": r.transport,
            "bytes": r.bytes,
            "agent_fetch_s": r.seconds,
            "agent_read_s": r.read_seconds,
            "path": r.path,
            "lookup_s": t1 - t0,
            "reserve_s": t2 - t1,
            "fetch_rpc_s": t3 - t2,
            "load_s": t4 - t3,
            "slots": slots,
        }

    def turn2(self, conv: int, n: int, new: int, hashes: list[str], reps: int) -> dict[str, Any]:
        """TTFT of turn 2 (n context + `new` tokens): recompute vs fetch through kvdir."""
        tokens = conversation(conv, n + new, self.shape.vocab).to(self.device)
        chain = [bytes.fromhex(h) for h in hashes]
        nb = len(chain)
        ids = self._take(-(-(n + new) // 16))
        table = torch.tensor(ids, device=self.device)
        out: dict[str, Any] = {"blocks": nb, "bytes": nb * self.mover.block_bytes}
        try:
            out["recompute"] = self._recompute(tokens, table, reps)
            out["fetch"] = self._fetch(tokens, chain, ids, table, n, reps)
            out["digests"] = block_digest(self.layers, ids[:nb])
            out["bare_copy_s"] = self._bare(nb * self.mover.block_bytes, reps)
            out["load_kernel_s"] = self._load_kernel(ids[:nb], reps)
        finally:
            self.free_blocks += ids
        return out

    def _recompute(self, tokens: torch.Tensor, table: torch.Tensor, reps: int) -> dict[str, Any]:
        ttft = []
        for rep in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = self.engine.forward(self.cache, tokens, 0, table)
            int(logits.argmax().item())
            if rep:
                ttft.append(time.perf_counter() - t0)
        return {"ttft_s": _ms(ttft)}

    def _fetch(
        self,
        tokens: torch.Tensor,
        chain: list[bytes],
        ids: list[int],
        table: torch.Tensor,
        n: int,
        reps: int,
    ) -> dict[str, Any]:
        rows, ttft, cold = [], [], {}
        for rep in range(reps + 1):  # rep 0: warm-up (handshake, IPC open, kernels)
            self.cache.tensor[:, :, table] = 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f = self.fetch_once(chain, ids)
            start = f["valid"] * 16
            logits = self.engine.forward(self.cache, tokens[start:], start, table)
            int(logits.argmax().item())
            t = time.perf_counter() - t0
            self.client.free(self.ns, f.pop("slots"))
            if rep == 0:
                cold = {"ttft_s": t, **f}
                continue
            ttft.append(t)
            rows.append(f)
        keys = ("lookup_s", "reserve_s", "fetch_rpc_s", "load_s", "agent_fetch_s", "agent_read_s")
        res: dict[str, Any] = {k: _ms([r[k] for r in rows]) for k in keys}
        res.update(
            ttft_s=_ms(ttft),
            fetch_s=_ms([r["fetch_rpc_s"] + r["load_s"] for r in rows]),
            valid=rows[-1]["valid"],
            transport=rows[-1]["transport"],
            path=rows[-1]["path"],
            data_path_s=_ms([r["agent_read_s"] + r["load_s"] for r in rows]),
            bytes=rows[-1]["bytes"],
            cold=cold,
        )
        return res

    def _load_kernel(self, ids: list[int], reps: int) -> float:
        """GPU time (CUDA events) of the worker's batched load of len(ids) blocks:
        parameter upload and kernel, without the host's launch and wait."""
        cp = load_cupy()
        st = external_stream(cp, self.mover.load_stream)
        slots = list(range(len(ids)))
        times = []
        for rep in range(reps + 1):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(st)
            self.mover.load(slots, ids, after=self._stream())
            e1.record(st)
            e1.synchronize()
            if rep:
                times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        return _ms(times)

    def _bare(self, nbytes: int, reps: int) -> float:
        """One cudaMemcpy of the fetched bytes (device to device): the baseline."""
        cp = load_cupy()
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for rep in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bare_copy(cp, self.device.index, dst.data_ptr(), src.data_ptr(), nbytes)
            torch.cuda.synchronize()
            if rep:
                times.append(time.perf_counter() - t0)
        return _ms(times)

    def race(self, hashes: list[str]) -> dict[str, Any]:
        """A fetch whose directory records went stale (the holder reused a block)."""
        chain = [bytes.fromhex(h) for h in hashes]
        ids = self._take(len(chain))
        try:
            f = self.fetch_once(chain, ids)
            self.client.free(self.ns, f.pop("slots"))
            return f
        finally:
            self.free_blocks += ids

    def local_race(self, count: int, index: int) -> dict[str, Any]:
        """The worker's own seqlock: slots of this node's pool read into vLLM blocks
        while one of them is reused (generation bumped) between lookup and read."""
        ids = self._take(count)
        hashes = [os.urandom(16) for _ in range(count)]
        slots = self.client.allocate(self.ns, count).slots
        try:
            assert self.mover.save("local", ids, slots, hashes, after=self._stream())
            while not self.mover.finished_saves():
                pass
            self.client.stored(self.ns, hashes, slots)
            self.client.flush()
            gens = self.mover.generations(slots)  # what the lookup saw
            self.pool.evict(slots[index])  # the reuse: generation first
            ev = self.mover.load(slots, ids, after=self._stream())
            self.mover.wait(ev, WAIT_S)
            return {"valid": self.mover.validated(slots, hashes, gens), "reused": index}
        finally:
            self.client.free(self.ns, slots)
            self.free_blocks += ids

    def quit(self) -> None:
        self.tier_channel.close()
        self.client.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ["KVDIR_NODE"] = a.name
    try:
        w = Worker(a)
        print(json.dumps({"ok": True, **w.hello()}), flush=True)
    except Exception as e:
        traceback.print_exc()
        print(json.dumps({"ok": False, "error": repr(e)}), flush=True)
        return 1
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op")
        if op == "quit":
            w.quit()
            return 0
        try:
            print(json.dumps({"ok": True, **getattr(w, op)(**msg)}), flush=True)
        except Exception as e:
            traceback.print_exc()
            print(json.dumps({"ok": False, "error": repr(e)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
