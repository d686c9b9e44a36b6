"""The simulated clients: Publish / Remove / linearizable Lookup, and their history.

Each key (one block of one agent, as in the chaos workload) has one
sequential writer: its next operation starts only when the last one is
answered or given up on. An operation goes to any running replica through
the entry the server uses (`Replica.propose_blob`: a follower refuses a write,
and forwards a Barrier to the leader), and its outcome is pysyncobj's
callback read through `syncobj.result_of`. A linearizable lookup commits a `Barrier` at that
replica and reads its table in the callback, which pysyncobj runs right
after the replica applied the barrier (as `RaftConsensus.barrier` + `read`).

History times are a logical clock (every invoke and every completion takes
the next number), so the checker sees the exact real-time order. An
operation whose replica crashed, or that was not answered within
`OP_TIMEOUT_S` of simulated time, is recorded as unknown.

With `retries`, a client behaves as kvdir's client does (kvdir/core/client.py):
an attempt refused (NOT_APPLIED) is tried again at the leader the refusing
replica names, and an attempt whose outcome is unknown, whose replica
crashed or that was not answered within `ATTEMPT_TIMEOUT_S`, is tried again
at another running replica, until `OP_TIMEOUT_S`. The operation is acknowledged
when any attempt commits, and it is then on record as one operation from its
first invoke to that answer: an earlier attempt that lands after it (a copy
forwarded late) is a violation the history check catches.

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
from kvdir.core.client import BACKOFF_S_MAX, BACKOFF_S_MIN
from kvdir.directory import codec
from kvdir.directory.commands import Barrier, Command, Publish, RegisterNode, Remove, Tier
from kvdir.directory.consensus.port import Outcome
from kvdir.directory.consensus.syncobj import result_of
from kvdir.directory.table import Table

NAMESPACE = "sim/model|16|bf16|paged"
LEASE_MS = 600_000
OP_TIMEOUT_S = 3.0
"""Simulated seconds a client waits for an answer before it counts the outcome unknown."""
ATTEMPT_TIMEOUT_S = 0.5
"""With retries: simulated seconds one attempt waits before the client tries elsewhere."""
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
    cmd: Command
    owner: int
    k: int
    attempt: int = 0
    attempt_deadline: float = 0.0
    in_flight: bool = True
    unknown: bool = False
    """An earlier attempt's outcome is unknown: the operation can no longer be a 'fail'."""
    retry_at: str | None = None
    """A retry is due: at this replica (the leader a refusal named), or anywhere ("")."""
    retry_after: float = 0.0
    """Not before this time: the client's backoff (kvdir/core/client.py's bounds)."""


@dataclass
class Workload:
    owners: int
    keys_per_owner: int
    rng: random.Random
    retries: bool = False
    now: Callable[[], float] = lambda: 0.0
    """The simulated time, read without advancing it (for the backoff of `retries`)."""
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    registered: set[int] = field(default_factory=set)
    registering: dict[int, float] = field(default_factory=dict)
    leader_heard: str = ""
    """With retries: the leader the last refusal named (a registration or a bulk
    publish goes there, as an agent's client goes to the leader it heard of)."""
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
                if self.retries and self.leader_heard in replicas:
                    addr, seat = self.leader_heard, replicas[self.leader_heard]
                self._propose(seat, register_command(owner, now), self._on_registered(owner, seat))
                return f"register {owner_node(owner)} at {addr}"
        if bulk and BULK_OWNER in self.registered:
            if self.retries and self.leader_heard in replicas:
                addr, seat = self.leader_heard, replicas[self.leader_heard]
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
        p = _Pending(
            key, kind, value, addr, seat.incarnation, self.tick(), now + OP_TIMEOUT_S, cmd, owner, k
        )
        p.attempt_deadline = now + (ATTEMPT_TIMEOUT_S if self.retries else OP_TIMEOUT_S)
        self.busy[key] = p
        self._propose(seat, cmd, self._on_done(p, seat, owner, k))
        return f"{kind} {key} g{value} at {addr}"

    def _propose(self, seat: Any, cmd: Command, done: Callable[[Any], None]) -> None:
        seat.replica.propose_blob(
            codec.encode(cmd),
            lambda res, err: done(result_of(res, err)),
            may_forward=isinstance(cmd, Barrier),
        )

    def retry(self, now: float, replicas: dict[str, Any]) -> list[str]:
        """Start the retries that are due (with `retries`); returns what was started."""
        started = []
        running = sorted(replicas)
        for key in sorted(self.busy):
            p = self.busy[key]
            if p.retry_at is None or now >= p.deadline or now < p.retry_after or not running:
                continue
            addr = p.retry_at if p.retry_at in replicas else self.rng.choice(running)
            seat = replicas[addr]
            p.attempt += 1
            p.replica, p.incarnation, p.retry_at, p.in_flight = addr, seat.incarnation, None, True
            p.attempt_deadline = now + ATTEMPT_TIMEOUT_S
            self._propose(seat, p.cmd, self._on_done(p, seat, p.owner, p.k))
            started.append(f"retry {p.kind} {key} g{p.value} at {addr} (attempt {p.attempt + 1})")
        return started

    # -------------------------------------------------------------- answers

    def _on_registered(self, owner: int, seat: Any) -> Callable[[Any], None]:
        def done(res: Any) -> None:
            if res.outcome is Outcome.COMMITTED:
                self.registered.add(owner)
            elif self.retries and res.outcome is Outcome.NOT_APPLIED:
                # As an agent does: register again at once, at the leader named.
                self.registering[owner] = 0.0
                self.leader_heard = _leader_named(seat)

        return done

    def _on_done(self, p: _Pending, seat: Any, owner: int, k: int) -> Callable[[Any], None]:
        attempt = p.attempt

        def done(res: Any) -> None:
            if self.busy.get(p.key) is not p or p.attempt != attempt or not p.in_flight:
                return  # an attempt given up on (timeout or crash), as a client's RPC is
            p.in_flight = False
            if self.retries and res.outcome is not Outcome.COMMITTED:
                p.unknown |= res.outcome is Outcome.UNKNOWN
                if res.outcome is Outcome.NOT_APPLIED:
                    p.retry_at = self.leader_heard = _leader_named(seat)
                else:
                    p.retry_at = ""
                self._backoff(p)
                return
            del self.busy[p.key]
            if res.outcome is Outcome.NOT_APPLIED:
                self._record(p, "fail")
            elif res.outcome is Outcome.UNKNOWN:
                self._record(p, "unknown")
            elif p.kind == "read":
                table = seat.replica.table if seat.replica is not None else None
                self._record(p, "ok", value=_generation(table, owner, k))
            else:
                # After an attempt whose outcome is unknown, the answer is the retry's:
                # an earlier attempt may have applied, so the count says nothing.
                result = self._result(res.result)
                self._record(p, "ok", result=None if p.unknown else result)

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
        """Operations whose replica crashed or whose time ran out become unknown; with
        `retries`, an attempt whose replica crashed or whose time ran out is retried
        (`retry`) until the operation's time runs out."""
        for key in sorted(self.busy):
            p = self.busy[key]
            lost = p.in_flight and (
                now >= p.attempt_deadline or not alive(p.replica, p.incarnation)
            )
            if now >= p.deadline or (lost and not self.retries):
                del self.busy[key]
                self._record(p, "unknown" if p.unknown or p.in_flight else "fail")
            elif lost:
                p.unknown, p.in_flight, p.retry_at = True, False, ""
                self._backoff(p)

    def _backoff(self, p: _Pending) -> None:
        pause = min(BACKOFF_S_MAX, BACKOFF_S_MIN * 2**p.attempt) * (0.5 + self.rng.random())
        p.retry_after = self.now() + pause

    def final_state(self, table: Table) -> dict[str, int | None]:
        return {
            key_name(o, k): _generation(table, o, k)
            for o in range(self.owners)
            for k in range(self.keys_per_owner)
        }


def _leader_named(seat: Any) -> str:
    """The leader's address as the replica at `seat` knows it (a refusal's hint), or ""."""
    r = seat.replica
    leader = r._getLeader() if r is not None else None
    return "" if leader is None else str(leader.address)


def register_command(owner: int, now: float) -> RegisterNode:
    """The agent `owner`'s registration (incarnation 1, a long lease)."""
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


__all__ = ["NAMESPACE", "OP_TIMEOUT_S", "Workload", "register_command"]
