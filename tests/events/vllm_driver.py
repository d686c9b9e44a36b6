"""Drive vLLM's REAL event publisher and prefix-cache BlockPool (run by tests/events).

Runs under a vLLM virtualenv (scripts/install-vllm.sh), never under kvdir's:
it imports nothing from kvdir. Commands arrive as JSON lines on stdin and each
gets one JSON line on stdout once vLLM's publisher thread has sent what the
command published (`_event_queue.join()`), so the test knows it is on the wire.

    {"op": "store", "rid": R, "tokens": [...]}  allocate, cache_full_blocks, publish
    {"op": "free", "rid": R}                     free (blocks stay cached: no event)
    {"op": "evict", "blocks": N}                 allocate N (-1: all free): evicts cached
    {"op": "clear"}                              free all, reset_prefix_cache
    {"op": "drop_next"}                          the next message is lost on the wire
    {"op": "quit"}

The only fault injected is `drop_next`: the PUB socket swallows one message,
which vLLM still keeps in its replay buffer (a message lost in the network).
Hashes in replies: ints as ints, bytes as hex strings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any


class _DroppingSocket:
    """Wraps the publisher's PUB socket; swallows one send when armed."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.drop = 0

    def send_multipart(self, frames: Any, *a: Any, **k: Any) -> Any:
        if self.drop:
            self.drop -= 1
            return None
        return self.sock.send_multipart(frames, *a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _hashes(events: list[Any], kind: str) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if type(e).__name__ == kind:
            out += [h.hex() if isinstance(h, bytes) else h for h in e.block_hashes]
    return out


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        kv_events = importlib.import_module("vllm.distributed.kv_events")
        block_pool = importlib.import_module("vllm.v1.core.block_pool")
        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        hashing = importlib.import_module("vllm.utils.hashing")
        self.request_mod = importlib.import_module("vllm.v1.request")
        self.sampling = importlib.import_module("vllm.sampling_params")
        self.kv = kv_events
        hash_fn = hashing.get_hash_fn_by_name(args.hash_algo)
        utils.init_none_hash(hash_fn)
        self.hasher = utils.get_request_block_hasher(args.block_size, hash_fn)
        self.block_size = args.block_size
        self.pool = block_pool.BlockPool(
            num_gpu_blocks=args.num_blocks,
            enable_caching=True,
            hash_block_size=args.block_size,
            enable_kv_cache_events=True,
        )
        self.pub = kv_events.ZmqEventPublisher(
            data_parallel_rank=args.dp_rank,
            endpoint=args.endpoint,
            replay_endpoint=args.replay_endpoint or None,
            topic=args.topic,
        )
        self.wire = _DroppingSocket(self.pub._pub)
        self.pub._pub = self.wire
        self.requests: dict[str, tuple[Any, list[Any]]] = {}

    def publish(self) -> list[Any]:
        events = self.pool.take_events()
        if events:
            self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
            self.pub._event_queue.join()
        return list(events)

    def store(self, rid: str, tokens: list[int]) -> dict[str, Any]:
        req = self.request_mod.Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=self.sampling.SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        n = len(tokens) // self.block_size
        blocks = self.pool.get_new_blocks(n)
        removed = self.publish_pending_removals()
        self.pool.cache_full_blocks(req, blocks, 0, n, self.block_size, 0)
        self.requests[rid] = (req, blocks)
        events = self.publish()
        return {"stored": _hashes(events, "BlockStored"), "removed": removed}

    def publish_pending_removals(self) -> list[Any]:
        return _hashes(self.publish(), "BlockRemoved")

    def free(self, rid: str) -> dict[str, Any]:
        _, blocks = self.requests.pop(rid)
        self.pool.free_blocks(reversed(blocks))
        return {"removed": _hashes(self.publish(), "BlockRemoved")}

    def evict(self, n: int) -> dict[str, Any]:
        n = n if n > 0 else self.pool.get_num_free_blocks()
        blocks = self.pool.get_new_blocks(n)
        removed = _hashes(self.publish(), "BlockRemoved")
        self.pool.free_blocks(blocks)
        return {"removed": removed}

    def clear(self) -> dict[str, Any]:
        for _, blocks in self.requests.values():
            self.pool.free_blocks(blocks)
        self.requests.clear()
        ok = self.pool.reset_prefix_cache()
        events = self.publish()
        return {"ok": ok, "events": [type(e).__name__ for e in events]}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "store":
            return self.store(cmd["rid"], cmd["tokens"])
        if op == "free":
            return self.free(cmd["rid"])
        if op == "evict":
            return self.evict(cmd["blocks"])
        if op == "clear":
            return self.clear()
        if op == "drop_next":
            self.wire.drop += 1
            return {}
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay-endpoint", default="")
    p.add_argument("--topic", default="")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--hash-algo", default="sha256")
    args = p.parse_args()
    driver = Driver(args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = driver.handle(cmd)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    driver.pub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
