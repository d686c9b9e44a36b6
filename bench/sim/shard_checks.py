"""The end of a run of groups: what the healed, converged groups must show.

- `move_unfinished`: the move must have finished (healing gives it all the time
  it needs; `move_failed` is reported where a step was refused).
- `map_differs`: g0's committed map is the plan's final map.
- `not_linearizable`: each key's writes (publishes and removes, unknown outcomes
  anywhere after their invoke or never) are linearizable (`bench.chaos.checker`).
- `lookup_not_linearizable`: with its linearizable lookups added, still: every
  lookup saw a state the key's shard had committed at some point within it.
- `lost_write`: each key's record in the group that owns it under the final map,
  as one more read after everything, follows from some order of its history: an
  acknowledged write is missing, or an acknowledged remove undone, otherwise.
- `foreign_entry`: no group holds an entry of a key it does not own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.chaos.checker import by_key, check_key
from bench.chaos.history import Op
from bench.sim.shard_clients import generation
from kvdir.core.shard_map import ShardMap, shard_key
from kvdir.directory.shard_view import HOME_GROUP
from kvdir.directory.table import Table

if TYPE_CHECKING:
    from bench.sim.groups import GroupsSimulation


def check_end(sim: GroupsSimulation) -> None:
    if sim.mover.busy:
        sim.violation("move_unfinished", f"the move stopped at {sim.mover.stage!r}")
    tables = _tables(sim)
    home = tables.get(HOME_GROUP)
    final = None if home is None else home.shard_map
    if final is None:
        sim.violation("map_differs", "g0 has no leader or no committed map at the end")
        return
    if sim.mover.finished and final != sim.plan.final():
        sim.violation("map_differs", f"g0 ends with {final.to_json()}"[:300])
    _history(sim, tables, final)
    for gid, t in sorted(tables.items()):
        _foreign(sim, gid, t, final)


def _tables(sim: GroupsSimulation) -> dict[str, Table]:
    """Each group's leader's table (the group converged: every member applied the same)."""
    out: dict[str, Table] = {}
    for gid, g in sim.groups.items():
        leader = g.leader()
        r = None if leader is None else g.seats[leader].replica
        if r is not None:
            out[gid] = r.table
        else:
            sim.violation("stuck", f"{gid} has no leader at the end")
    return out


def _history(sim: GroupsSimulation, tables: dict[str, Table], final: ShardMap) -> None:
    ops = [o for o in sim.clients.ops if o.outcome != "fail"]
    keyed = by_key(ops)
    end = float(sim.clients.tick())
    for key in sim.clients.keys:
        history = keyed.get(key.name, [])
        writes = [o for o in history if o.kind != "read"]
        if check_key(writes) != "ok":
            sim.violation("not_linearizable", f"key {key.name}: its writes")
            continue
        if check_key(history) != "ok":
            sim.violation("lookup_not_linearizable", f"key {key.name}: {_first_bad_read(history)}")
            continue
        owner = final.shard_of(key.hash).group_id
        t = tables.get(owner)
        if t is None:
            continue
        value = generation(t, key)
        read = Op(key.name, "read", key.name, end, end, "ok", value=value, mode="lin")
        if check_key([*history, read]) != "ok":
            acked = [o.value for o in writes if o.outcome == "ok"]
            sim.violation(
                "lost_write",
                f"key {key.name}: {owner} ends with g{value}, which follows from no order "
                f"of its history (acknowledged writes of generations {acked[-4:]})",
            )


def _first_bad_read(history: list[Op]) -> str:
    """The first lookup (in invoke order) that no order of the writes can explain."""
    writes = [o for o in history if o.kind != "read"]
    reads = sorted((o for o in history if o.kind == "read"), key=lambda o: o.invoke)
    for i, o in enumerate(reads):
        if check_key([*writes, *reads[: i + 1]]) != "ok":
            return (
                f"the lookup at {o.replica} (times {o.invoke:.0f}-{o.complete:.0f}) "
                f"saw g{o.value}, which no order of the writes explains"
            )
    return "its lookups together"


def _foreign(sim: GroupsSimulation, gid: str, t: Table, final: ShardMap) -> None:
    held = [
        key
        for blocks in t.blocks
        for key, _ in blocks.items()
        if final.shard_of_key(shard_key(key)).group_id != gid
    ]
    if held:
        sim.violation(
            "foreign_entry",
            f"{gid} holds {len(held)} keys it does not own under v{final.version}, "
            f"e.g. {held[0].hex()} in shard {final.shard_of(held[0]).shard_id}",
        )


__all__ = ["check_end"]
