"""Drive SGLang's REAL KV-event publisher and event recorder (run by tests/events).

Runs under the small venv of scripts/install-sglang.sh, never under kvdir's: it
imports nothing from kvdir. Importing the sglang package pulls torch and triton,
so only the modules that make and publish KV events are loaded, from the files
of SGLang's own wheel extracted under HOME/src:

- sglang.srt.disaggregation.kv_events: `EventPublisherFactory` (from the JSON of
  `--kv-events-config`), `ZmqEventPublisher` (PUB + replay ROUTER, its own
  thread), `KVEventBatch`, `BlockStored`, `BlockRemoved`, `AllBlocksCleared`;
- sglang.srt.mem_cache.events: `KVCacheEventRecorder`, which the radix cache
  calls on insert / evict / reset and which turns a node into events (page
  hashes as int64 of the first 8 digest bytes, parent links, coalescing);
- sglang.srt.mem_cache.utils + cpp_utils/native_hash: the page-hash chain, through
  SGLang's C++ SHA-256 extension (built by the install script).

Stubbed, as irrelevant to publishing: sglang.kernels.ops.kvcache.mla_buffer
(triton kernels utils.py re-exports), sglang.srt.runtime_context (parallel ranks
of a live server), and sglang.srt.utils.cpp_extension_loader (torch's build
step; the stub imports the prebuilt extension). The radix tree itself (torch
tensors) is reduced to the node attributes the recorder reads (key.token_ids,
extra_key, cache_salt, is_bigram, parent, hash_value, event_hash_value).

Commands arrive as JSON lines on stdin; each gets one JSON line on stdout once
the publisher thread has sent what the command published (`_event_queue.join()`):

    {"op": "store", "node": N, "tokens": [...], "parent": P?, "medium": M?}
                     a radix node (child of node P, else of the root) is inserted
    {"op": "remove", "node": N, "medium": M?}   the node is evicted
    {"op": "clear"}                             reset: AllBlocksCleared
    {"op": "drop_next"}                         the next message is lost on the wire
    {"op": "quit"}

Replies of store/remove: the int64 hashes of the published events and, for a
store, the node's SHA-256 page digests (hex) they were taken from.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

_STUBBED = (
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.kvcache",
    "sglang.kernels.ops.kvcache.mla_buffer",
    "sglang.srt.runtime_context",
    "sglang.srt.utils.cpp_extension_loader",
)


def _stub(name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package too, so children can be stubbed
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _no_kernel(name: str) -> Any:
    def kernel(*a: Any, **k: Any) -> Any:
        raise RuntimeError(f"{name}: a GPU kernel, stubbed by sglang_driver")

    return kernel


def load(home: Path) -> dict[str, Any]:
    """SGLang's kv_events, events and utils modules, from HOME/src."""
    sys.path[:0] = [str(home / "src"), str(home / "ext")]  # namespace packages
    for name in _STUBBED[:3]:
        _stub(name)
    _stub("sglang.kernels.ops.kvcache.mla_buffer", __getattr__=_no_kernel)
    _stub(
        "sglang.srt.runtime_context",
        get_parallel=lambda: types.SimpleNamespace(
            pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=0
        ),
    )
    _stub(
        "sglang.srt.utils.cpp_extension_loader",
        load_extension_with_recovery=lambda name, **_: importlib.import_module(name),
    )
    mods = {
        "kv_events": importlib.import_module("sglang.srt.disaggregation.kv_events"),
        "events": importlib.import_module("sglang.srt.mem_cache.events"),
        "utils": importlib.import_module("sglang.srt.mem_cache.utils"),
    }
    for m in mods.values():
        assert str(home) in (m.__file__ or ""), f"{m.__name__} not from {home}: {m.__file__}"
    return mods


class Key:
    """The attributes of SGLang's RadixKey that the recorder and hashing read."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.extra_key: str | None = None
        self.cache_salt: str | None = None
        self.is_bigram = False

    def __len__(self) -> int:
        return len(self.token_ids)


class Node:
    """The attributes of SGLang's TreeNode that the recorder reads."""

    def __init__(self, key: Key, parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.hash_value: list[str] | None = [] if parent is None else None
        self.event_hash_value: list[str] | None = None


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


class Driver:
    def __init__(self, args: argparse.Namespace, mods: dict[str, Any]) -> None:
        self.kv = mods["kv_events"]
        config = {
            "publisher": "zmq",
            "endpoint": args.endpoint,
            "replay_endpoint": args.replay_endpoint or None,
            "topic": args.topic,
        }
        self.pub = self.kv.EventPublisherFactory.create(json.dumps(config), args.dp_rank)
        assert type(self.pub).__name__ == "ZmqEventPublisher"
        self.wire = _DroppingSocket(self.pub._pub)
        self.pub._pub = self.wire
        self.recorder = mods["events"].KVCacheEventRecorder(enabled=True, page_size=args.page_size)
        self.root = Node(Key([]), None)
        self.nodes: dict[str, Node] = {}

    def publish(self) -> list[Any]:
        events = self.recorder.take()
        if events:
            self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
            self.pub._event_queue.join()
        return list(events)

    def store(self, cmd: dict[str, Any]) -> dict[str, Any]:
        parent = self.nodes[cmd["parent"]] if cmd.get("parent") else self.root
        node = Node(Key(list(cmd["tokens"])), parent)
        self.nodes[cmd["node"]] = node
        self.recorder.record_store(node, cmd.get("medium"))
        events = self.publish()
        return {
            "stored": [h for e in events for h in e.block_hashes],
            "types": [type(e).__name__ for e in events],
            "digests": node.hash_value,
        }

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "store":
            return self.store(cmd)
        if op == "remove":
            self.recorder.record_remove(self.nodes.pop(cmd["node"]), cmd.get("medium"))
            events = self.publish()
            return {"removed": [h for e in events for h in e.block_hashes]}
        if op == "clear":
            self.nodes.clear()
            self.recorder.record_all_cleared()
            return {"events": [type(e).__name__ for e in self.publish()]}
        if op == "drop_next":
            self.wire.drop += 1
            return {}
        raise ValueError(f"unknown op {op!r}")


def check(mods: dict[str, Any]) -> None:
    """The install script's probe: the modules load and the native hash runs."""
    digests = mods["utils"].get_hash_str(list(range(8)), None, page_size=4)
    assert len(digests) == 2 and all(len(d) == 64 for d in digests), digests


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--home", required=True, help="scripts/install-sglang.sh's DEST")
    p.add_argument("--check", action="store_true")
    p.add_argument("--endpoint", default="")
    p.add_argument("--replay-endpoint", default="")
    p.add_argument("--topic", default="")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()
    mods = load(Path(args.home))
    if args.check:
        check(mods)
        return 0
    driver = Driver(args, mods)
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
