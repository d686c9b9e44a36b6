"""The multi-group simulator's clients: Publish / Remove / linearizable Lookup, routed by map.

As `workload` does for one group, each key (one block of one agent) has one
sequential writer, and every operation is recorded in a per-key history
(`bench.chaos.history.Op`, logical times). What differs is the routing: each
agent holds a shard map (fetched from a g0 replica, as the sharded client's
GetShardMap does) and sends a key's operation to a running replica of the
group that owns the key under that map. A refusal that proves nothing was
applied sends it to the map again and then to the right group:

- the replica's `ShardView` refuses the key (`WrongShard`: FAILED_PRECONDITION
  wrong_shard at the server) or knows no map yet (UNAVAILABLE no_shard_map);
- the state machine refuses the write (`Rejected` SHARD_FENCED: the key's shard
  is frozen or still importing in that group).

Either way the agent refreshes its map and tries again `RETRY_STEPS` later,
until `OP_TIMEOUT_S` after the operation began: then it is recorded as failed
when no attempt may have applied, and unknown when one may. Every agent
registers in every group first (as agents do: a group's imports apply only
to nodes it knows).

A linearizable lookup commits a `Barrier` at the replica and reads its table
in the callback (as `workload` does). The keys are chosen so that every shard
of the run's final map holds `KEYS_PER_SHARD` of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.chaos.history import Op
from bench.chaos.workload import block_hash, key_name, owner_node, record_of
from bench.sim.group import SimGroup
from bench.sim.workload import NAMESPACE, OP_TIMEOUT_S, register_command
from kvdir.core.shard_map import ShardMap
from kvdir.directory.commands import (
    Barrier,
    Command,
    Publish,
    Reject,
    Rejected,
    Remove,
    Tier,
)
from kvdir.directory.consensus.port import Outcome, WriteResult
from kvdir.directory.shard_view import HOME_GROUP, NoShardMap, WrongShard
from kvdir.directory.table import Table

OWNERS = 3
KEYS_PER_SHARD = 3
RETRY_STEPS = 5
"""Steps (50 ms) between a refused attempt and the next."""
MAX_NODES = 64


@dataclass(frozen=True, slots=True)
class Key:
    owner: int
    k: int

    @property
    def name(self) -> str:
        return key_name(self.owner, self.k)

    @property
    def hash(self) -> bytes:
        return block_hash(self.owner, self.k)


def choose_keys(final: ShardMap, rng: random.Random) -> list[Key]:
    """`KEYS_PER_SHARD` keys in every shard of `final`, spread over the agents."""
    want = {s.shard_id: KEYS_PER_SHARD for s in final.shards}
    keys: list[Key] = []
    k = 0
    while any(want.values()):
        key = Key(rng.randrange(OWNERS), k)
        k += 1
        sid = final.shard_of(key.hash).shard_id
        if want[sid]:
            want[sid] -= 1
            keys.append(key)
    return keys


@dataclass
class _Pending:
    key: Key
    kind: str
    value: int | None
    invoke: int
    deadline: float
    retry_at: int = 0
    prefer: str = ""
    """The replica to try next (the leader a refusal named), if it runs."""
    waiting: tuple[str, str, int] | None = None
    """(group, replica, its incarnation) of the attempt whose answer is awaited."""
    attempts: int = 0
    replica: str = ""


@dataclass
class ShardClients:
    groups: dict[str, SimGroup]
    keys: list[Key]
    rng: random.Random
    note: Callable[[str], None]
    violation: Callable[[str, str], None]
    reads_ignore_map: bool = False
    """Sabotage (tests only): lookups go to the key's first owner, unchecked by any view,
    whatever the map says (the lookup check must then fail)."""
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    maps: dict[int, ShardMap] = field(default_factory=dict)
    registered: set[tuple[int, str]] = field(default_factory=set)
    registering: dict[tuple[int, str], float] = field(default_factory=dict)
    gen: dict[str, int] = field(default_factory=dict)
    busy: dict[str, _Pending] = field(default_factory=dict)
    first_owner: dict[str, str] = field(default_factory=dict)
    leader_heard: dict[str, str] = field(default_factory=dict)
    """Per group, the leader the last refusal of a registration named."""
    refusals: int = 0
    """Attempts refused as wrong-shard, no-map or fenced (then retried)."""

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ maps

    def fetch(self) -> ShardMap | None:
        """The map a running g0 replica holds (its applied table), as GetShardMap answers."""
        home = self.groups[HOME_GROUP]
        up = home.running()
        if not up:
            return None
        r = home.seats[self.rng.choice(up)].replica
        return None if r is None else r.table.shard_map

    def _refresh(self, owner: int) -> None:
        m = self.fetch()
        held = self.maps.get(owner)
        if m is not None and (held is None or m.version > held.version):
            self.maps[owner] = m

    # ---------------------------------------------------------------- starts

    def start_op(self, now: float, step: int) -> str:
        """Register an agent somewhere it is not yet, or start one key's operation."""
        for owner in range(OWNERS):
            for gid in sorted(self.groups):
                if (owner, gid) in self.registered:
                    continue
                if now < self.registering.get((owner, gid), 0.0):
                    continue
                up = self.groups[gid].running()
                if not up:
                    continue
                hint = self.leader_heard.get(gid, "")
                addr = hint if hint in up else self.rng.choice(up)
                self.registering[(owner, gid)] = now + OP_TIMEOUT_S
                done = self._registered(owner, gid, addr)
                self.groups[gid].propose(addr, register_command(owner, now), done)
                return f"register {owner_node(owner)} at {gid} {addr}"
        ready = {o for o in range(OWNERS) if all((o, g) in self.registered for g in self.groups)}
        idle = [key for key in self.keys if key.name not in self.busy and key.owner in ready]
        if not idle or any(owner not in self.maps for owner in range(OWNERS)):
            for owner in range(OWNERS):
                self._refresh(owner)
            return ""
        key = self.rng.choice(idle)
        roll = self.rng.random()
        gen = self.gen.get(key.name, 0)
        if roll < 0.55:
            gen = self.gen[key.name] = gen + 1
            kind, value = "publish", gen
        elif roll < 0.7:
            kind, value = "remove", gen
        else:
            kind, value = "read", None
        p = _Pending(key, kind, value, self.tick(), now + OP_TIMEOUT_S)
        self.busy[key.name] = p
        self._attempt(p, step)
        return f"{kind} {key.name} g{value}"

    def _registered(self, owner: int, gid: str, addr: str) -> Callable[[WriteResult, int], None]:
        def done(res: WriteResult, _index: int) -> None:
            if res.outcome is Outcome.COMMITTED:
                self.registered.add((owner, gid))
            elif res.outcome is Outcome.NOT_APPLIED:  # as an agent does: at once, at the leader
                self.registering[(owner, gid)] = 0.0
                self.leader_heard[gid] = self.groups[gid].leader_named(addr)

        return done

    # -------------------------------------------------------------- attempts

    def step(self, now: float, step: int) -> None:
        """Give up on what timed out or lost its replica; retry what was refused."""
        for name in sorted(self.busy):
            p = self.busy[name]
            w = p.waiting
            if w is not None and not self.groups[w[0]].alive(w[1], w[2]):
                self._record(p, "unknown")  # its replica crashed: it may still commit
            elif now >= p.deadline:
                # unknown while an attempt may still commit; failed when every one was refused
                self._record(p, "unknown" if w is not None else "fail")
            elif w is None and step >= p.retry_at:
                self._attempt(p, step)

    def _attempt(self, p: _Pending, step: int) -> None:
        owner, h = p.key.owner, p.key.hash
        m = self.maps[owner]
        gid = m.shard_of(h).group_id
        if p.kind == "read" and self.reads_ignore_map:
            gid = self.first_owner.setdefault(p.key.name, gid)
        group = self.groups[gid]
        up = group.running()
        if not up:
            p.retry_at = step + RETRY_STEPS
            return
        addr = p.prefer if p.prefer in up else self.rng.choice(up)
        p.prefer = ""
        p.attempts += 1
        if not (p.kind == "read" and self.reads_ignore_map):
            try:
                group.view(addr, self.fetch, m.version).check([h])
            except (WrongShard, NoShardMap) as e:
                self._refused(p, step, f"{gid} {addr}: {type(e).__name__}")
                return
        seat = group.seats[addr]
        p.waiting = (gid, addr, seat.incarnation)
        p.replica = f"{gid} {addr}"
        cmd: Command
        if p.kind == "publish":
            assert p.value is not None
            cmd = _publish(p.key, p.value)
        elif p.kind == "remove":
            assert p.value is not None
            cmd = _remove(p.key, p.value)
        else:
            cmd = Barrier()
        group.propose(addr, cmd, self._answer(p, group, addr))

    def _refused(self, p: _Pending, step: int, why: str) -> None:
        self.refusals += 1
        self._refresh(p.key.owner)
        p.retry_at = step + RETRY_STEPS
        if p.attempts in (1, 10, 100):
            self.note(f"{p.kind} {p.key.name} refused ({why}), attempt {p.attempts}: retries")

    def _answer(
        self, p: _Pending, group: SimGroup, addr: str
    ) -> Callable[[WriteResult, int], None]:
        def done(res: WriteResult, _index: int) -> None:
            if self.busy.get(p.key.name) is not p or p.waiting is None:
                return  # given up on already (timeout or crash): recorded as unknown
            p.waiting = None
            if res.outcome is Outcome.NOT_APPLIED:
                # Truly not applied (a write is taken by the leader only): again at the
                # leader the replica names, as kvdir's client does.
                p.prefer = group.leader_named(addr)
                p.retry_at = group.step + RETRY_STEPS
            elif res.outcome is Outcome.UNKNOWN:
                self._record(p, "unknown")
            elif isinstance(res.result, Rejected):
                if res.result.reason is Reject.SHARD_FENCED:
                    self._refused(p, group.step, f"{group.gid} {addr}: fenced")
                    return
                self.violation("write_rejected", f"{p.kind} {p.key.name}: {res.result}"[:300])
                self._record(p, "fail")
            elif p.kind == "read":
                r = group.seats[addr].replica
                # As the server's Lookup after its barrier: a key in a shard the table
                # has fenced is refused (shard_moving), not read (unless sabotaged).
                fenced = r is not None and r.table.fence.lookup_refusal([p.key.hash])
                if fenced and not self.reads_ignore_map:
                    self._refused(p, group.step, f"{group.gid} {addr}: shard moving")
                    return
                value = None if r is None else generation(r.table, p.key)
                self._record(p, "ok", value=value)
            else:
                self._record(p, "ok", result=_count(res.result))

        return done

    def _record(
        self, p: _Pending, outcome: str, value: int | None = None, result: int | None = None
    ) -> None:
        del self.busy[p.key.name]
        complete = self.tick()
        if p.kind == "read":
            outcome = outcome if outcome == "ok" else "fail"  # an unanswered read had no effect
        else:
            value = p.value
        self.ops.append(
            Op(
                process=p.key.name,
                kind=p.kind,  # type: ignore[arg-type]
                key=p.key.name,
                invoke=float(p.invoke),
                complete=float(complete),
                outcome=outcome,  # type: ignore[arg-type]
                value=value,
                result=result,
                mode="lin" if p.kind == "read" else "",
                replica=p.replica,
            )
        )


def generation(table: Table, key: Key) -> int | None:
    """The generation `table` holds for `key` (None: no record)."""
    node = owner_node(key.owner)
    for m in table.lookup(NAMESPACE, [key.hash], MAX_NODES):
        if m.node.node_id == node:
            return int(table.records(list(m.slots)[:1]).generations[0])
    return None


def _count(value: object) -> int | None:
    for name in ("applied", "removed"):
        n = getattr(value, name, None)
        if n is not None:
            return int(n)
    return None


def _publish(key: Key, gen: int) -> Publish:
    addr, length, rkey = record_of(key.owner, key.k, gen)
    return Publish(
        owner_node(key.owner),
        1,
        NAMESPACE,
        int(Tier.GPU),
        [key.hash],
        [addr],
        [length],
        [rkey],
        [gen],
    )


def _remove(key: Key, gen: int) -> Remove:
    return Remove(owner_node(key.owner), 1, NAMESPACE, int(Tier.GPU), [key.hash], [gen])


def nodes() -> list[tuple[str, int]]:
    """Every agent's (node id, incarnation)."""
    return [(owner_node(o), 1) for o in range(OWNERS)]


__all__ = ["KEYS_PER_SHARD", "Key", "ShardClients", "choose_keys", "generation", "nodes"]
