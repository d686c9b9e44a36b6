"""The simulated clients: Publish / Remove / linearizable Lookup, and their history.

Each key (one block of one agent, as in the chaos workload) has one
sequential writer: its next operation starts only when the last one is
answered or given up on. An operation goes to any running replica through
the entry the server uses (`Replica.propose_blob`; a follower forwards it to
the leader), and its outcome is pysyncobj's callback read through
`syncobj.result_of`. A linearizable lookup commits a `Barrier` at that
replica and reads its table in the callback, which pysyncobj runs right
after the replica applied the barrier (as `RaftConsensus.barrier` + `read`).

History times are a logical clock (every invoke and every completion takes
the next number), so the checker sees the exact real-time order. An
operation whose replica crashed, or that was not answered within
`OP_TIMEOUT_S` of simulated time, is recorded as unknown.

A few agents also publish chains of thousands of blocks in one command
(larger than pysyncobj's 64 KiB append batches); those are not in the key
model, they exercise the chunked appends.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.history import Op
from bench.chaos.workload import block_hash, key_name, owner_node, record_of
from kvdir.directory import codec
from kvdir.directory.commands import Barrier, Command, Publish, RegisterNode, Remove, Tier
from kvdir.directory.consensus.port import Outcome
from kvdir.directory.consensus.syncobj import result_of
from kvdir.directory.table import Table

NAMESPACE = "sim/model|16|bf16|paged"
LEASE_MS = 600_000
OP_TIMEOUT_S = 3.0
"""Simulated seconds a client waits for an answer before it counts the outcome unknown."""
BULK_OWNER = 999
"""The agent whose large publishes are outside the key model."""
MAX_NODES = 64


@dataclass
class _Pending:
    key: str
    kind: str
    value: int | None
    replica: str
    incarnation: int
    invoke: int
    deadline: float


@dataclass
class Workload:
    owners: int
    keys_per_owner: int
    rng: random.Random
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    registered: set[int] = field(default_factory=set)
    registering: dict[int, float] = field(default_factory=dict)
    gen: dict[str, int] = field(default_factory=dict)
    busy: dict[str, _Pending] = field(default_factory=dict)
    rejected: int = 0
    bulk_publishes: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # --------------------------------------------------------------- starts

    def start_op(self, now: float, replicas: dict[str, Any], bulk: bool) -> str:
        """Start one operation at a random running replica; returns what was started."""
        running = sorted(replicas)
        if not running:
            return ""
        addr = self.rng.choice(running)
        seat = replicas[addr]
        for owner in [*range(self.owners), BULK_OWNER]:
            if owner not in self.registered and now >= self.registering.get(owner, 0.0):
                self.registering[owner] = now + OP_TIMEOUT_S
                self._propose(seat, _register(owner, now), self._on_registered(owner))
                return f"register {owner_node(owner)} at {addr}"
        if bulk and BULK_OWNER in self.registered:
            self.bulk_publishes += 1
            size = self.rng.randint(1500, 3000)
            self._propose(seat, _bulk(size, self.bulk_publishes), lambda _r: None)
            return f"publish {size} blocks at {addr}"
        idle = [
            (o, k)
            for o in sorted(self.registered - {BULK_OWNER})
            for k in range(self.keys_per_owner)
            if key_name(o, k) not in self.busy
        ]
        if not idle:
            return ""
        owner, k = self.rng.choice(idle)
        return self._key_op(now, seat, addr, owner, k)

    def _key_op(self, now: float, seat: Any, addr: str, owner: int, k: int) -> str:
        key = key_name(owner, k)
        roll = self.rng.random()
        gen = self.gen.get(key, 0)
        if roll < 0.55:
            gen = self.gen[key] = gen + 1
            kind, value = "publish", gen
            cmd: Command = _publish(owner, k, gen)
        elif roll < 0.7:
            kind, value, cmd = "remove", gen, _remove(owner, k, gen)
        else:
            kind, value, cmd = "read", None, Barrier()
        p = _Pending(key, kind, value, addr, seat.incarnation, self.tick(), now + OP_TIMEOUT_S)
        self.busy[key] = p
        self._propose(seat, cmd, self._on_done(p, seat, owner, k))
        return f"{kind} {key} g{value} at {addr}"

    def _propose(self, seat: Any, cmd: Command, done: Callable[[Any], None]) -> None:
        seat.replica.propose_blob(codec.encode(cmd), lambda res, err: done(result_of(res, err)))

    # -------------------------------------------------------------- answers

    def _on_registered(self, owner: int) -> Callable[[Any], None]:
        def done(res: Any) -> None:
            if res.outcome is Outcome.COMMITTED:
                self.registered.add(owner)

        return done

    def _on_done(self, p: _Pending, seat: Any, owner: int, k: int) -> Callable[[Any], None]:
        def done(res: Any) -> None:
            if self.busy.get(p.key) is not p:
                return  # given up on already (timeout or crash): recorded as unknown
            del self.busy[p.key]
            if res.outcome is Outcome.NOT_APPLIED:
                self._record(p, "fail")
            elif res.outcome is Outcome.UNKNOWN:
                self._record(p, "unknown")
            elif p.kind == "read":
                table = seat.replica.table if seat.replica is not None else None
                self._record(p, "ok", value=_generation(table, owner, k))
            else:
                self._record(p, "ok", result=self._result(res.result))

        return done

    def _result(self, value: Any) -> int | None:
        applied = getattr(value, "applied", None)
        if applied is not None:
            return int(applied)
        removed = getattr(value, "removed", None)
        if removed is not None:
            return int(removed)
        self.rejected += 1  # a Rejected: the workload sent something the table refuses
        return None

    def _record(
        self, p: _Pending, outcome: str, value: int | None = None, result: int | None = None
    ) -> None:
        complete = self.tick()
        if p.kind == "read":
            if outcome != "ok":
                outcome = "fail"  # a read that was not answered had no effect
        else:
            value = p.value
        self.ops.append(
            Op(
                process=p.key,
                kind=p.kind,  # type: ignore[arg-type]
                key=p.key,
                invoke=float(p.invoke),
                complete=float(complete),
                outcome=outcome,  # type: ignore[arg-type]
                value=value,
                result=result,
                mode="lin" if p.kind == "read" else "",
                replica=p.replica,
            )
        )

    # ------------------------------------------------------------ give up

    def expire(self, now: float, alive: Callable[[str, int], bool]) -> None:
        """Operations whose replica crashed or whose time ran out become unknown."""
        for key in sorted(self.busy):
            p = self.busy[key]
            if now >= p.deadline or not alive(p.replica, p.incarnation):
                del self.busy[key]
                self._record(p, "unknown")

    def final_state(self, table: Table) -> dict[str, int | None]:
        return {
            key_name(o, k): _generation(table, o, k)
            for o in range(self.owners)
            for k in range(self.keys_per_owner)
        }


def _register(owner: int, now: float) -> RegisterNode:
    return RegisterNode(
        node_id=owner_node(owner),
        host=f"host-{owner}",
        endpoint=f"10.77.1.{owner % 250}:9000",
        transports=("tcp",),
        incarnation=1,
        lease_ms=LEASE_MS,
        now_ms=int(now * 1000),
    )


def _publish(owner: int, k: int, gen: int) -> Publish:
    addr, length, rkey = record_of(owner, k, gen)
    return Publish(
        node_id=owner_node(owner),
        incarnation=1,
        namespace=NAMESPACE,
        tier=int(Tier.GPU),
        hashes=[block_hash(owner, k)],
        addresses=[addr],
        lengths=[length],
        rkeys=[rkey],
        generations=[gen],
    )


def _remove(owner: int, k: int, gen: int) -> Remove:
    return Remove(
        node_id=owner_node(owner),
        incarnation=1,
        namespace=NAMESPACE,
        tier=int(Tier.GPU),
        hashes=[block_hash(owner, k)],
        generations=[gen],
    )


def _bulk(size: int, gen: int) -> Publish:
    hashes = [block_hash(BULK_OWNER, k) + b"bulk-chain-pad..." for k in range(size)]
    return Publish(
        node_id=owner_node(BULK_OWNER),
        incarnation=1,
        namespace=NAMESPACE,
        tier=int(Tier.GPU),
        hashes=hashes,
        addresses=[0x20_0000_0000 + k * 0x10000 for k in range(size)],
        lengths=[4096] * size,
        rkeys=[(gen * 7919 + k) & 0xFFFFFFFF for k in range(size)],
        generations=[gen] * size,
    )


def _generation(table: Table | None, owner: int, k: int) -> int | None:
    """The generation key (owner, k) holds in `table` (None: no record)."""
    if table is None:
        return None
    node = owner_node(owner)
    for m in table.lookup(NAMESPACE, [block_hash(owner, k)], MAX_NODES):
        if m.node.node_id == node:
            return int(table.records(list(m.slots)[:1]).generations[0])
    return None


__all__ = ["NAMESPACE", "OP_TIMEOUT_S", "Workload"]
