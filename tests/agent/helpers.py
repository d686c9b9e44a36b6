"""Helpers of the agent tier: real agents, real pools, real bytes.

Every wait is a `wait_for` on a condition with a deadline. Chains are unique
per test (`chain_of(salt, n)`), so tests sharing the directory and the agents
never see each other's blocks.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterable, Sequence

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, namespace
from kvdir.core.hashing import block_chain
from kvdir.local import ClusterError, LocalAgent, LocalCluster, wait_for

BLOCK_TOKENS = 16
SLOT_BYTES = 65_536
SLOTS = 128
MODEL = "agent-tier"
NS = namespace(MODEL, BLOCK_TOKENS)
POOL_SPEC = f"model={MODEL},block_tokens={BLOCK_TOKENS},slot_bytes={SLOT_BYTES},slots={SLOTS}"

WAIT_S = 30.0
"""Deadline of waits that finish in well under a second when things work."""

SERVED = 'kvdir_agent_mirror_lookups{source="mirror"}'
FALLBACK = 'kvdir_agent_mirror_lookups{source="rpc"}'
FRESH = "kvdir_agent_mirror_fresh"
"""An agent's directory mirror: lookups it answered, lookups a replica answered, fresh."""


def chain_of(salt: int, n: int) -> list[bytes]:
    """A block chain of `n` blocks no other test uses."""
    start = salt * 1_000_003
    return block_chain(list(range(start, start + n * BLOCK_TOKENS)), BLOCK_TOKENS)


def launch_all(agents: Iterable[LocalAgent], timeout_s: float = WAIT_S) -> None:
    """Start every agent, then wait for each (they start in parallel)."""
    agents = list(agents)
    for a in agents:
        with open(a.log_path, "ab") as log:
            a.proc = subprocess.Popen(
                a.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
    for a in agents:
        a.wait_ready(timeout_s)


def stop_all(agents: Iterable[LocalAgent]) -> None:
    """SIGTERM every live agent, then reap each (SIGKILL after a deadline)."""
    live = [a for a in agents if a.alive]
    for a in live:
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
    for a in live:
        assert a.proc is not None
        try:
            a.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait(timeout=15)


def write_blocks(engine: EngineClient, slots: Sequence[int], seed: int) -> list[bytes]:
    """Fill each slot with random bytes (the engine writing KV); returns them."""
    rng = random.Random(seed)
    out = []
    for s in slots:
        data = rng.randbytes(SLOT_BYTES)
        engine.slot_view(NS, s)[:] = data
        out.append(data)
    return out


def slot_bytes(engine: EngineClient, slot: int) -> bytes:
    return bytes(engine.slot_view(NS, slot))


def store_chain(
    engine: EngineClient, chain: list[bytes], seed: int
) -> tuple[list[int], list[bytes]]:
    """Allocate, write and announce `chain`: what an engine does after a prefill."""
    alloc = engine.allocate(NS, len(chain))
    payload = write_blocks(engine, alloc.slots, seed)
    engine.stored(NS, chain, alloc.slots)
    engine.flush()
    return alloc.slots, payload


def prefixes(c: DirectoryClient, chain: list[bytes], address: str) -> dict[str, int]:
    """Holder node -> prefix blocks of `chain`, as one replica answers now."""
    resp = c.lookup(NS, chain, address=address)
    return {m.node_id: m.prefix_blocks for m in resp.matches}


def wait_prefix(
    cluster: LocalCluster,
    c: DirectoryClient,
    chain: list[bytes],
    node: str,
    blocks: int,
    timeout_s: float = WAIT_S,
    readers: Sequence[EngineClient] = (),
) -> None:
    """Wait until every replica answers `node` holds exactly `blocks` leading blocks
    (0: `node` is absent), so whichever replica a reader asks agrees; then until
    each of `readers` (agents about to fetch) sees the same: an agent reads its
    in-process mirror of the directory, which follows a replica by a few ms."""

    seen: list[int] = []

    def agreed() -> bool:
        seen[:] = [prefixes(c, chain, a).get(node, 0) for a in cluster.grpc_addresses]
        return all(n == blocks for n in seen)

    try:
        wait_for(agreed, timeout_s, f"{node} to hold {blocks} blocks on every replica", 0.05)
    except ClusterError as e:
        raise ClusterError(f"{e} (the replicas last said {seen})") from None
    for engine in readers:
        wait_seen(engine, chain, node, blocks, timeout_s)


def seen_by(engine: EngineClient, chain: list[bytes]) -> dict[str, int]:
    """Peer -> prefix blocks of `chain`, as the engine's agent answers its Lookup."""
    return {p.node_id: p.prefix_blocks for p in engine.lookup(NS, chain).peers}


def wait_seen(
    engine: EngineClient, chain: list[bytes], node: str, blocks: int, timeout_s: float = WAIT_S
) -> None:
    """Wait until the engine's agent says peer `node` holds `blocks` leading blocks
    (0: absent), whichever way it reads the directory (its mirror, or a replica)."""
    last: list[dict[str, int]] = [{}]

    def agreed() -> bool:
        last[0] = seen_by(engine, chain)
        return last[0].get(node, 0) == blocks

    try:
        wait_for(agreed, timeout_s, f"the agent to see {node} hold {blocks} blocks", 0.02)
    except ClusterError as e:
        raise ClusterError(f"{e} (it last said {last[0]})") from None


def node_info(c: DirectoryClient, node: str) -> tuple[int, int] | None:
    """(incarnation, entries) of `node` as the directory lists it, or None."""
    for n in c.list_nodes().nodes:
        if n.node_id == node:
            return n.incarnation, n.entries
    return None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(metrics_address: str) -> dict[str, float]:
    """A Prometheus text page as {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out
