"""The replay's real components: N `kvdir agent serve` processes on a real directory.

Each simulated node is a real agent with its own shared-memory pool of
`capacity_blocks` slots of `block_bytes` (KV scaled down from the model's
block size; the same factor everywhere). Every block a node computes is real
bytes written into a slot it allocated and announced with `stored`; every
pull is the agent's `Fetch` (directory lookup, one batched transfer from the
holder, validation of the holder's slot headers), after which the replay
checks each delivered block byte for byte. Every eviction is a `Free`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

import xxhash

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, namespace
from kvdir.local import LocalAgent
from kvdir.replay.sim import Pulled, node_name
from kvdir.routing.directory_source import DirectorySource
from kvdir.routing.policy import Prompt
from kvdir.v1 import directory_pb2 as pb

AGENT_START_TIMEOUT_S = 120.0
FETCH_TIMEOUT_MS = 10_000
BLOCK_BYTES_MIN = 64


def block_hash(block_id: int) -> bytes:
    """The directory key of trace block `block_id` (8 bytes)."""
    return xxhash.xxh3_64_digest(block_id.to_bytes(8, "little"))


def block_bytes_of(block_id: int, size: int) -> bytes:
    """Deterministic KV stand-in for a block: what its prefill would have written."""
    return xxhash.xxh3_128_digest(block_id.to_bytes(8, "little")) * (size // 16)


def check_block_bytes(size: int) -> None:
    if size < BLOCK_BYTES_MIN or size % 16:
        raise ValueError(f"block bytes must be a multiple of 16, at least {BLOCK_BYTES_MIN}")


def start_agents(
    base: str,
    directory: Sequence[str],
    nodes: int,
    model: str,
    block_tokens: int,
    block_bytes: int,
    slots: int,
    transports: str,
) -> list[LocalAgent]:
    """Start `nodes` agents at once (their start-up overlaps), then wait for each."""
    spec = (
        f"model={model},dtype=bf16,block_tokens={block_tokens},layout=replay,"
        f"slot_bytes={block_bytes},slots={slots}"
    )
    agents = [
        LocalAgent(
            node_name(i), base, list(directory), spec, transports=transports, lease_ms=10_000
        )
        for i in range(nodes)
    ]
    try:
        for a in agents:
            with open(a.log_path, "ab") as log:
                a.proc = subprocess.Popen(
                    a.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        for a in agents:
            a.wait_ready(AGENT_START_TIMEOUT_S)
    except BaseException:
        stop_agents(agents)
        raise
    return agents


def stop_agents(agents: Sequence[LocalAgent]) -> None:
    for a in agents:
        if a.alive:
            a.stop()


class RealBackend:
    """`sim.Backend` over real agents (one per node, same order as the replay's nodes)."""

    def __init__(
        self,
        agents: Sequence[LocalAgent],
        directory: DirectoryClient,
        model: str,
        block_tokens: int,
        block_bytes: int,
    ) -> None:
        check_block_bytes(block_bytes)
        self.ns: pb.Namespace = namespace(model, block_tokens, "bf16", "replay")
        self.block_bytes = block_bytes
        self.engines = [EngineClient(a.engine_socket) for a in agents]
        self.source = DirectorySource(directory, self.ns)
        self._slots: list[dict[int, int]] = [{} for _ in agents]
        self._hashes: dict[int, bytes] = {}

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def _chain(self, ids: Sequence[int]) -> list[bytes]:
        out = []
        for b in ids:
            h = self._hashes.get(b)
            if h is None:
                h = self._hashes[b] = block_hash(b)
            out.append(h)
        return out

    def peer_prefix(self, node: int, chain: Sequence[int], local: int) -> tuple[int, int]:
        resp = self.engines[node].lookup(self.ns, self._chain(chain))
        peer = max((p.prefix_blocks for p in resp.peers), default=0)
        return resp.local_blocks, peer

    def holders(self, chain: Sequence[int]) -> Prompt:
        return self.source.prompt(self._chain(chain))

    def store(self, node: int, chain: Sequence[int], start: int, pull_to: int) -> Pulled | None:
        new = chain[start:]
        if not new:
            return None
        e = self.engines[node]
        alloc = e.allocate(self.ns, len(new))
        slots = alloc.slots
        hashes = self._chain(new)
        pulled: Pulled | None = None
        valid = 0
        if pull_to > start:
            k = pull_to - start
            got = e.fetch(self.ns, hashes[:k], slots[:k], timeout_ms=FETCH_TIMEOUT_MS)
            valid = got.valid_blocks
            wrong = sum(
                1
                for b, s in zip(new[:valid], slots[:valid], strict=True)
                if bytes(e.slot_view(self.ns, s)) != block_bytes_of(b, self.block_bytes)
            )
            pulled = Pulled(valid, k, got.bytes, got.seconds, got.transport, got.invalidated, wrong)
        for b, s in zip(new[valid:], slots[valid:], strict=True):
            e.slot_view(self.ns, s)[:] = block_bytes_of(b, self.block_bytes)
        e.stored(self.ns, hashes, slots)
        # The agent has the notifications before the next request asks it (its local
        # index then matches the model's); the publish to the directory stays async.
        e.flush()
        table = self._slots[node]
        for b, s in zip(new, slots, strict=True):
            table[b] = s
        return pulled

    def evict(self, node: int, victims: Sequence[tuple[int, int]]) -> None:
        if not victims:
            return
        table = self._slots[node]
        for b, _ in victims:
            table.pop(b, None)
        self.engines[node].free(self.ns, [s for _, s in victims])

    def slots_of(self, node: int, blocks: Sequence[int]) -> list[int]:
        table = self._slots[node]
        return [table[b] for b in blocks]


def shm_base() -> str | None:
    """A directory on a shared-memory filesystem for the pool files, if there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None
