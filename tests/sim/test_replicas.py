"""Seeded replica simulation of the directory's state machine.

One seed makes one committed command log, the way the leader would: agents
register, heartbeat, publish and remove prefix chains, retry writes whose
outcome they did not learn (so a publish or remove may be committed twice in a
row of that agent's commands), crash (then the leader's sweep proposes
ExpireNodes, sometimes racing a heartbeat), restart with a new incarnation, and
send late commands from an old incarnation. Every entry goes through the codec,
as it does through Raft.

Replicas apply the log in lockstep:

- replica 0 applies it with the retried duplicates left out (a duplicate must
  change nothing, so its state must match the others' at every step);
- the others apply every entry, and at random points take a snapshot (capture,
  then write later, as the background writer does), load it from the file and
  carry on, or "crash": reload an earlier snapshot and re-apply the log since,
  which must reproduce the results they reported the first time.

All replicas must agree on every command's result and on a digest of their
state (node information and sorted lookups of every chain the log published).
A failure names its seed; rerun it alone with `-k seed_<n>`. Set
KVDIR_SIM_SEEDS to run another number of seeds (default 20).
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvdir.directory import codec, snapshot
from kvdir.directory.commands import (
    Barrier,
    ClearNode,
    Command,
    Expired,
    ExpireNodes,
    Heartbeat,
    Publish,
    Published,
    Registered,
    RegisterNode,
    Rejected,
    Remove,
    Removed,
    Result,
    Tier,
)
from kvdir.directory.limits import EXPIRE_NODES_PER_COMMAND_MAX
from kvdir.directory.table import Table

DEFAULT_SEEDS = 20
LOG_LENGTH = 400
REPLICAS = 5
NAMESPACES = ("llama\x1fbf16\x1f16\x1fnhd\x1f0/1", "qwen\x1fbf16\x1f32\x1fhnd\x1f0/2")
HASH_WIDTH = {NAMESPACES[0]: 8, NAMESPACES[1]: 32}
AGENTS = ("gpu-node-a", "gpu-node-b", "gpu-node-c", "gpu-node-d", "gpu-node-ü")


def seeds() -> list[int]:
    raw = os.environ.get("KVDIR_SIM_SEEDS", "").strip()
    return list(range(int(raw) if raw else DEFAULT_SEEDS))


# ----------------------------------------------------------------- workload


@dataclass
class Agent:
    node_id: str
    incarnation: int = 0
    alive: bool = False
    lease_ms: int = 1_000
    generation: int = 0
    next_addr: int = 0x10_0000
    held: dict[tuple[str, int, bytes], tuple[int, int]] = field(default_factory=dict)
    """What this agent believes it published: (ns, tier, hash) -> (address, generation)."""
    retry: Command | None = None
    """A write whose outcome the agent did not learn; it resends it next."""


@dataclass
class Log:
    entries: list[bytes] = field(default_factory=list)
    duplicate: list[bool] = field(default_factory=list)
    chains: list[tuple[str, list[bytes]]] = field(default_factory=list)
    """Every (namespace, chain) a lookup should be asked about."""


class Workload:
    """Generates a committed log from a seed; the leader's own table decides sweeps."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 1_000_000
        self.leader_since = self.now
        self.leader = Table()
        self.agents = [Agent(n) for n in AGENTS]
        self.log = Log()
        self.docs: dict[str, list[list[bytes]]] = {ns: self._documents(ns) for ns in NAMESPACES}
        for ns, docs in self.docs.items():
            for doc in docs:
                self.log.chains.append((ns, doc))
                self.log.chains.extend((ns, doc[j:]) for j in range(1, len(doc), 3))

    def _documents(self, ns: str) -> list[list[bytes]]:
        """Prompts sharing prefixes: a few system prompts, each with continuations."""
        width = HASH_WIDTH[ns]
        docs = []
        for _ in range(3):
            stem = [self.rng.randbytes(width) for _ in range(self.rng.randint(1, 4))]
            for _ in range(self.rng.randint(1, 3)):
                tail = [self.rng.randbytes(width) for _ in range(self.rng.randint(0, 8))]
                docs.append(stem + tail)
        return docs

    def commit(self, cmd: Command, duplicate: bool = False) -> None:
        self.log.entries.append(codec.encode(cmd))
        self.log.duplicate.append(duplicate)
        self.leader.apply(cmd)

    def run(self, length: int) -> Log:
        while len(self.log.entries) < length:
            self.step()
        return self.log

    def step(self) -> None:
        rng = self.rng
        self.now += rng.randint(0, 120)
        roll = rng.random()
        if roll < 0.02:  # a new leader: its clock may lag the old one's a little
            self.now -= rng.randint(0, 200)
            self.leader_since = self.now
            return
        if roll < 0.10:
            self.sweep()
            return
        if roll < 0.12:
            self.commit(Barrier())
            return
        self.act(rng.choice(self.agents))

    def sweep(self) -> None:
        expired = self.leader.expired_nodes(
            self.now, EXPIRE_NODES_PER_COMMAND_MAX, self.leader_since
        )
        if not expired:
            return
        # A heartbeat committed between the decision and the ExpireNodes wins.
        for a in self.agents:
            if a.alive and (a.node_id, a.incarnation) in expired and self.rng.random() < 0.5:
                self.commit(Heartbeat(a.node_id, a.incarnation, self.now))
        self.commit(ExpireNodes(self.now, tuple(expired)))

    def act(self, a: Agent) -> None:
        rng = self.rng
        if a.retry is not None:  # the agent's next command resends the unknown write
            cmd, a.retry = a.retry, None
            self.commit(cmd, duplicate=True)
            return
        current = self.leader.nodes.get(a.node_id)
        if a.alive and (current is None or current.incarnation != a.incarnation):
            # Expired behind the agent's back: its writes are refused, it re-registers.
            if rng.random() < 0.5:
                self.publish(a)
            self.restart(a)
            return
        if not a.alive:
            if a.incarnation == 0 or rng.random() < 0.15:
                self.restart(a)
            elif a.incarnation > 1 and rng.random() < 0.1:
                self.zombie(a)
            return
        roll = rng.random()
        if roll < 0.30:
            self.commit(Heartbeat(a.node_id, a.incarnation, self.now))
        elif roll < 0.65:
            self.publish(a)
        elif roll < 0.80:
            self.remove(a)
        elif roll < 0.83:
            ns = rng.choice((None, *NAMESPACES))
            self.commit(ClearNode(a.node_id, a.incarnation, ns, False))
            a.held = {k: v for k, v in a.held.items() if ns is not None and k[0] != ns}
        elif roll < 0.85:  # graceful shutdown
            ns = rng.choice((None, *NAMESPACES))
            self.commit(ClearNode(a.node_id, a.incarnation, ns, True))
            a.alive, a.held = False, {}
        elif roll < 0.90:  # crash: no more heartbeats; the leader's sweep expires it
            a.alive = False
        elif roll < 0.93:
            self.zombie(a)
        else:
            self.now += rng.randint(0, 2 * a.lease_ms)  # a quiet spell

    def restart(self, a: Agent) -> None:
        a.incarnation += 1
        a.alive, a.held, a.generation = True, {}, 0
        a.lease_ms = self.rng.choice((500, 1_000, 3_000))
        host = f"host-{a.node_id}"
        self.commit(
            RegisterNode(
                a.node_id,
                host,
                f"{host}:{7000 + a.incarnation}",
                ("rdma", "tcp")[: self.rng.randint(0, 2)],
                a.incarnation,
                a.lease_ms,
                self.now,
            )
        )
        if self.rng.random() < 0.2:  # a duplicate register (client retry) renews
            self.commit(
                RegisterNode(a.node_id, host, f"{host}:1", (), a.incarnation, a.lease_ms, self.now)
            )

    def zombie(self, a: Agent) -> None:
        """A late command from an older incarnation (refused)."""
        old = self.rng.randint(0, max(a.incarnation - 1, 0))
        ns = self.rng.choice(NAMESPACES)
        doc = self.rng.choice(self.docs[ns])
        options: list[Command] = [
            Heartbeat(a.node_id, old, self.now),
            Publish(a.node_id, old, ns, 1, doc[:1], [1], [1], [1], [1]),
            Remove(a.node_id, old, ns, 1, doc[:1]),
            ClearNode(a.node_id, old, None, True),
        ]
        self.commit(self.rng.choice(options))

    def publish(self, a: Agent) -> None:
        rng = self.rng
        ns = rng.choice(NAMESPACES)
        doc = rng.choice(self.docs[ns])
        start = 0 if rng.random() < 0.8 else rng.randint(0, len(doc) - 1)
        end = rng.randint(start + 1, len(doc))
        tier = int(rng.choice((Tier.GPU, Tier.GPU, Tier.HOST)))
        hashes = doc[start:end]
        addrs, gens = [], []
        for h in hashes:
            addr, gen = a.held.get((ns, tier, h), (0, 0))
            if not addr or rng.random() < 0.2:  # a new block, or the block moved
                addr, a.next_addr = a.next_addr, a.next_addr + 4096
            a.generation += 1
            gen = a.generation if rng.random() < 0.9 else max(gen - 1, 0)  # sometimes stale
            addrs.append(addr)
            gens.append(gen)
        cmd = Publish(
            a.node_id,
            a.incarnation,
            ns,
            tier,
            list(hashes),
            addrs,
            [4096] * len(hashes),
            [rng.randint(0, 2**32 - 1)] * len(hashes),
            gens,
        )
        self.commit(cmd)
        for h, addr, gen in zip(hashes, addrs, gens, strict=True):
            old = a.held.get((ns, tier, h))
            if old is None or old[0] != addr or gen >= old[1]:
                a.held[(ns, tier, h)] = (addr, gen)
        if rng.random() < 0.1:
            a.retry = cmd

    def remove(self, a: Agent) -> None:
        rng = self.rng
        mine = sorted(a.held)
        if not mine:
            return
        ns, tier, _ = rng.choice(mine)
        keys = [k for k in mine if k[:2] == (ns, tier)]
        keys = rng.sample(keys, rng.randint(1, min(len(keys), 6)))
        hashes = [k[2] for k in keys]
        guard = rng.random()
        gens = [a.held[k][1] for k in keys] if guard < 0.5 else []
        addrs = [a.held[k][0] for k in keys] if 0.3 < guard < 0.8 else []
        if rng.random() < 0.1:  # a stray hash the agent never published
            hashes.append(rng.randbytes(HASH_WIDTH[ns]))
            gens += [0] if gens else []
            addrs += [0] if addrs else []
        cmd = Remove(a.node_id, a.incarnation, ns, tier, hashes, gens, addrs)
        self.commit(cmd)
        for k in keys:
            del a.held[k]
        if rng.random() < 0.1:
            a.retry = cmd


# ----------------------------------------------------------------- replicas


def digest(t: Table, chains: list[tuple[str, list[bytes]]]) -> str:
    """A hash of what the table answers: nodes, counts and sorted lookups."""
    h = hashlib.sha256()
    nodes = sorted(
        (
            n.node_id,
            n.host,
            n.endpoint,
            n.transports,
            n.incarnation,
            n.lease_ms,
            n.lease_expiry_ms,
            n.entries,
        )
        for n in t.nodes.values()
    )
    h.update(repr((nodes, t.entries, t.block_count)).encode())
    assert t.entries == sum(n.entries for n in t.nodes.values()), "entries owned by no node"
    for ns, chain in chains:
        for m in t.lookup(ns, chain, 64):
            assert m.node.node_id in t.nodes, "a lookup returned a forgotten node"
            r = t.records(m.slots)
            h.update(repr((ns, chain[0], m.node.node_id, m.prefix_blocks, r)).encode())
    return h.hexdigest()


@dataclass
class Replica:
    name: str
    table: Table = field(default_factory=Table)
    results: dict[int, Result] = field(default_factory=dict)
    skip_duplicates: bool = False
    snapshots: dict[int, Path] = field(default_factory=dict)
    """Log index -> a snapshot file holding the state before that entry."""
    pending: tuple[int, snapshot.Image, int] | None = None
    """(log index, captured image, write at index): the background writer's job."""


def apply_entry(r: Replica, log: Log, i: int) -> Result:
    return r.table.apply(codec.decode(log.entries[i]))


def run_seed(seed: int, tmp: Path) -> None:
    log = Workload(seed).run(LOG_LENGTH)
    rng = random.Random(seed * 7919 + 1)
    replicas = [Replica("r0", skip_duplicates=True)] + [
        Replica(f"r{k}") for k in range(1, REPLICAS)
    ]
    for i in range(len(log.entries)):
        for r in replicas:
            maybe_snapshot(r, log, i, rng, tmp)
            if r.skip_duplicates and log.duplicate[i]:
                continue
            r.results[i] = apply_entry(r, log, i)
        # Every replica that applied entry i reports the same result.
        applied = [r for r in replicas if i in r.results]
        first = applied[0].results[i]
        for r in applied[1:]:
            assert r.results[i] == first, (
                f"seed={seed}: entry {i} ({codec.decode(log.entries[i])!r}): "
                f"{r.name} got {r.results[i]!r}, {applied[0].name} got {first!r}"
            )
        if i % 50 == 49 or i == len(log.entries) - 1:
            digests = {r.name: digest(r.table, log.chains) for r in replicas}
            assert len(set(digests.values())) == 1, f"seed={seed}: after entry {i}: {digests}"


def maybe_snapshot(r: Replica, log: Log, i: int, rng: random.Random, tmp: Path) -> None:
    """Snapshot events of one replica before it applies entry i."""
    if r.skip_duplicates:
        return
    if r.pending is not None and r.pending[2] == i:  # the background writer finishes
        at, image, _ = r.pending
        path = tmp / f"{r.name}-{at}.snap"
        raft_entries = [(log.entries[j], j, 1) for j in range(max(0, at - 3), at)]
        snapshot.write(image, str(path), {"index": at}, raft_entries)
        r.snapshots[at] = path
        r.pending = None
    roll = rng.random()
    if roll < 0.01 and r.pending is None:
        r.pending = (i, snapshot.capture(r.table), i + rng.randint(0, 20))
    elif roll < 0.015:  # load a fresh snapshot and carry on from it
        path = tmp / f"{r.name}-now.snap"
        snapshot.write(snapshot.capture(r.table), str(path), {"index": i}, [])
        r.table, raft, _ = snapshot.read(str(path))
        assert raft == {"index": i}
    elif roll < 0.02 and r.snapshots:  # crash, restart from a snapshot, replay
        at = rng.choice(sorted(r.snapshots))
        table, raft, entries = snapshot.read(str(r.snapshots[at]))
        assert raft == {"index": at}
        assert entries == [(log.entries[j], j, 1) for j in range(max(0, at - 3), at)]
        r.table = table
        for j in range(at, i):
            again = apply_entry(r, log, j)
            assert again == r.results[j], (
                f"{r.name}: replaying entry {j} after restoring the snapshot at {at}: "
                f"{again!r} != {r.results[j]!r}"
            )


@pytest.mark.parametrize("seed", seeds(), ids=lambda s: f"seed_{s}")
def test_replicas_agree(seed: int, tmp_path: Path) -> None:
    try:
        run_seed(seed, tmp_path)
    except AssertionError as e:
        if f"seed={seed}" in str(e):
            raise
        raise AssertionError(f"seed={seed}: {e}") from e
    except Exception as e:
        raise AssertionError(f"seed={seed}: {type(e).__name__}: {e}") from e


def test_workload_covers_the_interesting_cases() -> None:
    """The generator is only useful if its logs do what the module docstring says."""
    seen: dict[str, int] = {}

    def count(what: str, yes: bool = True) -> None:
        seen[what] = seen.get(what, 0) + int(yes)

    for seed in range(5):
        log = Workload(seed).run(LOG_LENGTH)
        t = Table()
        for blob, dup in zip(log.entries, log.duplicate, strict=True):
            cmd = codec.decode(blob)
            res = t.apply(cmd)
            count(type(cmd).__name__)
            count("duplicate", dup)
            count("rejected", isinstance(res, Rejected))
            count("expired node", isinstance(res, Expired) and bool(res.nodes))
            if isinstance(cmd, ExpireNodes) and isinstance(res, Expired):
                count("expiry raced", len(res.nodes) < len(cmd.nodes))
            count("stale publish", isinstance(res, Published) and res.stale > 0)
            count("replaced", isinstance(res, Registered) and res.replaced_incarnation)
            count("removed", isinstance(res, Removed) and res.removed > 0)
    wanted = ["Publish", "Remove", "ClearNode", "Barrier", "duplicate", "rejected"]
    wanted += ["expired node", "expiry raced", "stale publish", "replaced", "removed"]
    for what in wanted:
        assert seen.get(what, 0) > 0, f"no {what} in seeds 0..4: {seen}"


def test_workload_is_deterministic() -> None:
    a, b = Workload(3).run(200), Workload(3).run(200)
    assert a.entries == b.entries
    assert a.duplicate == b.duplicate
    assert Workload(4).run(200).entries != a.entries
    assert any(a.duplicate)
