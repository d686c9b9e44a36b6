"""Runs INSIDE an agent's container: the engine's side of the image tier.

`podman exec -i AGENT python - MODE MODEL BLOCK_TOKENS BLOCKS SEED < engine.py`
runs it with the image's own venv (every kvdir import comes from the wheel in
the image, not from a checkout), as the image's user, next to the agent: it
maps the agent's pool in the pod's /dev/shm and talks to its Unix socket, as
an engine on that node would. It prints one JSON object.

- `store`: write BLOCKS blocks of seeded bytes into the pool, `stored()` them.
- `fetch`: look the chain up through this node's agent (it must name the
  other agent as the holder), pull it into this pool over the agents' TCP
  data path, and compare every byte with the seeded ones.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from typing import Any

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import namespace
from kvdir.core.hashing import block_chain
from kvdir.local import ClusterError, wait_for
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb

SOCKET = "/run/kvdir/agent.sock"
TIMEOUT_S = 30.0
POLL_S = 0.02


def chain(block_tokens: int, blocks: int, seed: int) -> list[bytes]:
    return block_chain(list(range(seed, seed + blocks * block_tokens)), block_tokens)


def payload(seed: int, block: int, size: int) -> bytes:
    return random.Random(seed * 1_000_003 + block).randbytes(size)


def store(engine: EngineClient, ns: pb.Namespace, hashes: list[bytes], seed: int) -> dict[str, Any]:
    slots = engine.allocate(ns, len(hashes)).slots
    for i, s in enumerate(slots):
        view = engine.slot_view(ns, s)
        view[:] = payload(seed, i, len(view))
    engine.stored(ns, hashes, slots)
    engine.flush()
    return {"slots": list(slots)}


def seen(engine: EngineClient, ns: pb.Namespace, hashes: list[bytes]) -> apb.EngineLookupResponse:
    """The agent's Lookup, once some peer holds the whole chain in it (or after
    TIMEOUT_S): the agent reads its own mirror of the directory, which follows the
    replicas the host already asked by a few ms."""
    last = [engine.lookup(ns, hashes)]

    def whole() -> bool:
        last[0] = engine.lookup(ns, hashes)
        return any(p.prefix_blocks == len(hashes) for p in last[0].peers)

    with contextlib.suppress(ClusterError):  # the caller's assertions say what was seen
        wait_for(whole, TIMEOUT_S, "a peer holding the whole chain", POLL_S)
    return last[0]


def fetch(engine: EngineClient, ns: pb.Namespace, hashes: list[bytes], seed: int) -> dict[str, Any]:
    found = seen(engine, ns, hashes)
    out: dict[str, Any] = {
        "local_blocks": found.local_blocks,
        "peers": {p.node_id: p.prefix_blocks for p in found.peers},
    }
    dst = engine.allocate(ns, len(hashes)).slots
    try:
        r = engine.fetch(ns, hashes, dst)
        got = [bytes(engine.slot_view(ns, s)) for s in dst[: r.valid_blocks]]
        out |= {
            "valid_blocks": r.valid_blocks,
            "source_node": r.source_node,
            "transport": r.transport,
            "bytes": r.bytes,
            "bytes_match": all(b == payload(seed, i, len(b)) for i, b in enumerate(got)),
        }
    finally:
        engine.free(ns, dst)
    return out


def main(argv: list[str]) -> int:
    mode, model, block_tokens, blocks, seed = argv
    ns = namespace(model, int(block_tokens))
    hashes = chain(int(block_tokens), int(blocks), int(seed))
    engine = EngineClient(SOCKET, timeout_s=TIMEOUT_S)
    try:
        run = {"store": store, "fetch": fetch}[mode]
        result = run(engine, ns, hashes, int(seed))
    finally:
        engine.close()
    result["hashes"] = [h.hex() for h in hashes]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
