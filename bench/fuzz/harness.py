"""The daemons under fuzz: a 3-replica directory and one agent, all real processes.

The agent ("fz-keeper") serves two pools: `KEEP_NS`, whose blocks are seeded
once and must never change, and `PLAY_NS`, which the fuzzer may use freely
(engine-socket cases are pinned to it half of the time). `check_intact`
proves after each batch that every process still serves and that the kept
entries are exactly as seeded, on every replica and in the agent's memory.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import grpc

from bench.fuzz.targets import Grant, tcp_read
from kvdir.agent.engine.client import EngineClient
from kvdir.agent.pool import Geometry
from kvdir.core.client import DirectoryClient, DirectoryError, HolderRecords, namespace, records
from kvdir.core.hashing import block_chain
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

KEEPER = "fz-keeper"
PLAY_NODE = "fz-play"
"""A node registered for the fuzzer's own writes (incarnation 1)."""
BLOCK_TOKENS = 16
SLOT_BYTES = 4096
SLOTS = 64
KEEP_BLOCKS = 16
KEEP_NS = namespace("fuzz-keep", BLOCK_TOKENS)
PLAY_NS = namespace("fuzz-play", BLOCK_TOKENS)
WAIT_S = 60.0


class FuzzFailure(AssertionError):
    """A daemon stopped serving, or a kept entry was lost or changed."""


def _pool_spec(ns: pb.Namespace) -> str:
    return f"model={ns.model},block_tokens={ns.block_tokens},slot_bytes={SLOT_BYTES},slots={SLOTS}"


@dataclass
class Kept:
    chain: list[bytes]
    slots: list[int]
    payload: list[bytes]
    records: HolderRecords


class Harness:
    def __init__(self, base_dir: str) -> None:
        self.base_dir = base_dir
        self.cluster = LocalCluster(os.path.join(base_dir, "directory"), size=3)
        self.agent: LocalAgent | None = None
        self.engine: EngineClient | None = None
        self.directory: DirectoryClient | None = None
        self.kept: Kept | None = None
        self.grant: Grant | None = None
        self.tcp_endpoint = ""

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        os.makedirs(self.cluster.base_dir, exist_ok=True)
        self.cluster.start(timeout_s=WAIT_S)
        self.directory = self.cluster.client(timeout_s=10)
        wait_for(
            lambda: len(self.cluster.statuses()) == 3, WAIT_S, "all three replicas to answer", 0.05
        )
        self.agent = LocalAgent(
            KEEPER,
            self.base_dir,
            self.cluster.grpc_addresses,
            _pool_spec(KEEP_NS),
            transports="tcp",
            lease_ms=20_000,
            extra_args=["--pool", _pool_spec(PLAY_NS)],
        )
        self.agent.launch(WAIT_S)
        self.engine = EngineClient(self.agent.engine_socket)
        self.directory.register_node(PLAY_NODE, "127.0.0.1", 1, "127.0.0.1:9", ["tcp"], 600_000)
        self._seed()

    def _seed(self) -> None:
        assert self.engine is not None and self.directory is not None
        chain = block_chain(list(range(KEEP_BLOCKS * BLOCK_TOKENS)), BLOCK_TOKENS)
        slots = self.engine.allocate(KEEP_NS, KEEP_BLOCKS).slots
        rng = random.Random(8)
        payload = []
        for s in slots:
            data = rng.randbytes(SLOT_BYTES)
            self.engine.slot_view(KEEP_NS, s)[:] = data
            payload.append(data)
        self.engine.stored(KEEP_NS, chain, slots)
        self.engine.flush()
        seen: list[HolderRecords] = []

        def everywhere() -> bool:
            seen[:] = [r for r in (self._records(a, chain) for a in self._addrs()) if r]
            return len(seen) == 3 and len({tuple(r.generations) for r in seen}) == 1

        wait_for(everywhere, WAIT_S, "every replica to index the kept blocks", 0.05)
        self.kept = Kept(chain, slots, payload, seen[0])
        hs = self.handshake()
        info = next(p for p in hs.pools if p.namespace == KEEP_NS)
        geo = Geometry.of(info.slot_bytes, info.slots)
        self.grant = Grant(info.header_address - geo.header_offset, geo.size, info.rkey, info.path)
        self.tcp_endpoint = next(t.params["endpoint"] for t in hs.transports if t.name == "tcp")

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.agent is not None:
            self.agent.stop()
        if self.directory is not None:
            self.directory.close()
        self.cluster.stop()

    # ----------------------------------------------------------------- checks

    def _addrs(self) -> list[str]:
        return self.cluster.grpc_addresses

    def _records(self, address: str, chain: list[bytes]) -> HolderRecords | None:
        assert self.directory is not None
        try:
            resp = self.directory.lookup(KEEP_NS, chain, address=address)
        except DirectoryError:
            return None
        for m in resp.matches:
            if m.node_id == KEEPER and m.prefix_blocks == len(chain):
                return records(m)
        return None

    def handshake(self) -> apb.HandshakeResponse:
        assert self.agent is not None
        with grpc.insecure_channel(self.agent.listen) as ch:
            resp: apb.HandshakeResponse = apb_grpc.AgentStub(ch).Handshake(
                apb.HandshakeRequest(version=1, node_id="fz-checker"), timeout=10
            )
            return resp

    def check_intact(self, after: str) -> None:
        """Every daemon serves and every kept entry is as seeded; else FuzzFailure."""
        assert self.kept is not None and self.engine is not None and self.grant is not None
        assert self.agent is not None
        dead = [r.replica_id for r in self.cluster.replicas if not r.alive]
        if dead or not self.agent.alive:
            raise FuzzFailure(f"after {after}: processes died: {dead or [KEEPER]}")
        for addr in self._addrs():
            got = self._records(addr, self.kept.chain)
            if got != self.kept.records:
                raise FuzzFailure(f"after {after}: replica {addr} lost or changed kept entries")
        local = self.engine.lookup(KEEP_NS, self.kept.chain)
        if local.local_blocks != len(self.kept.chain):
            raise FuzzFailure(f"after {after}: the agent indexes {local.local_blocks} kept blocks")
        for s, want in zip(self.kept.slots, self.kept.payload, strict=True):
            if bytes(self.engine.slot_view(KEEP_NS, s)) != want:
                raise FuzzFailure(f"after {after}: kept slot {s} changed")
        rec = self.kept.records
        segs = [(rec.addresses[0], rec.rkeys[0], rec.lengths[0])]
        if tcp_read(self.tcp_endpoint, self.grant, segs) != "ok":
            raise FuzzFailure(f"after {after}: the agent no longer serves a granted tcp read")
        self.handshake()
