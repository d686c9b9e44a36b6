"""The move protocol's commands applied to a `Table` (docs/sharding.md,
"Re-sharding online"): the server half of moving shard S from group A to B.

    A: FreezeShard(S)   from this log index A applies no write in S
    B: BeginImport(S)   B takes S's entries only by Import, refuses clients' writes
    B: Import(S, cmd)   one command of A's log (or of A's snapshot, as Publishes),
                        filtered to S's keys, applied to S's keys only
    B: ImportDone(S)    B has applied A's log up to A's freeze: S is B's
    A: DropShard(S, p)  A drops S's entries, a 256th of its table per command; S
                        stays fenced on A until a later move brings it back

Deterministic and pure, like the rest of the state machine; each command is
checked again here at apply time. An imported write names A's node
incarnation: B applies it only if B knows that node with that incarnation
(the agent registers in every group); otherwise it is counted stale, since
B's own registry is newer (a restarted agent's new incarnation cleared it).
Deletions imported from A (Remove, ClearNode, ExpireNodes) touch S's keys
only. Every deletion is safe: the worst is a miss, never a wrong record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdir.directory.block_index import SHARDS
from kvdir.directory.commands import (
    BeginImport,
    ClearNode,
    Done,
    DropShard,
    Expired,
    ExpireNodes,
    FreezeShard,
    Import,
    ImportDone,
    MoveCommand,
    Publish,
    Published,
    Reject,
    Rejected,
    Remove,
    Removed,
    Result,
)
from kvdir.directory.shard_fence import Range, key_of

if TYPE_CHECKING:
    from kvdir.directory.table import NodeState, Table

NIL = 0xFFFFFFFF


def apply(t: Table, cmd: MoveCommand) -> Result:
    match cmd:
        case FreezeShard() | BeginImport():
            return _fence(t, cmd)
        case Import():
            return _import(t, cmd)
        case ImportDone():
            if cmd.shard_id not in t.fence.importing:
                return _bad(f"shard {cmd.shard_id} is not being imported here")
            t.fence.end_import(cmd.shard_id)
            return Done()
        case DropShard():
            return _drop(t, cmd)


def _bad(message: str) -> Rejected:
    return Rejected(Reject.BAD_MOVE, message)


def _fence(t: Table, cmd: FreezeShard | BeginImport) -> Result:
    r = Range(cmd.shard_id, cmd.lo, cmd.hi)
    held = t.fence.frozen if isinstance(cmd, FreezeShard) else t.fence.importing
    if held.get(r.shard_id) == r:
        return Done()  # the same command again (a retried proposal)
    if isinstance(cmd, BeginImport):
        _lift_dropped_within(t, r)  # the keys come back: a finished drop's fence may go
    other = t.fence.overlaps(r.lo, r.hi)
    if other is not None or r.shard_id in t.fence.frozen or r.shard_id in t.fence.importing:
        which = r.shard_id if other is None else other.shard_id
        return _bad(f"shard {r.shard_id}'s keys are already fenced here (shard {which})")
    if isinstance(cmd, FreezeShard):
        t.fence.freeze(r)
    else:
        t.fence.begin_import(r)
    return Done()


def _lift_dropped_within(t: Table, r: Range) -> None:
    """Lift the fences of fully dropped shards that lie wholly inside `r`."""
    for f in list(t.fence.frozen.values()):
        if r.lo <= f.lo and f.hi <= r.hi and t.fence.drop_next[f.shard_id] == SHARDS:
            t.fence.drop(f.shard_id)


def _import(t: Table, cmd: Import) -> Result:
    r = t.fence.importing.get(cmd.shard_id)
    if r is None:
        return _bad(f"shard {cmd.shard_id} is not being imported here")
    inner = cmd.inner
    match inner:
        case Publish() | Remove():
            if not all(r.holds(key_of(h)) for h in inner.hashes):
                return Rejected(
                    Reject.BAD_BATCH, f"an Import names keys outside shard {r.shard_id}"
                )
            node = t.nodes.get(inner.node_id)
            if node is None or node.incarnation != inner.incarnation:
                if isinstance(inner, Publish):
                    return Published(0, len(inner.hashes))
                return Removed(0)
            return t._publish(inner) if isinstance(inner, Publish) else t._remove(inner)
        case ClearNode():
            node = t.nodes.get(inner.node_id)
            if node is None or node.incarnation != inner.incarnation:
                return Removed(0)
            every_ns = inner.namespace is None or inner.deregister
            ns = None if every_ns else t.ns_ids.get(inner.namespace or "")
            if not every_ns and ns is None:
                return Removed(0)
            return Removed(_drop_node_range(t, node, ns, r))
        case ExpireNodes():
            removed = 0
            for node_id, incarnation in inner.nodes:
                node = t.nodes.get(node_id)
                if node is not None and node.incarnation == incarnation:
                    removed += _drop_node_range(t, node, None, r)
            return Expired((), removed)


def _drop_node_range(t: Table, node: NodeState, ns: int | None, r: Range) -> int:
    """Drop `node`'s entries (in namespace `ns`, or all) whose keys `r` holds."""
    c = t.col
    s = node.head
    removed = 0
    while s != NIL:
        nxt = c.nnext[s]
        key = c.key[s]
        assert key is not None
        if (ns is None or c.ns[s] == ns) and r.holds(key_of(key)):
            t._unlink_block(t.blocks[c.ns[s]], key, s)
            t._release(s)
            removed += 1
        s = nxt
    return removed


def _drop(t: Table, cmd: DropShard) -> Result:
    r = t.fence.frozen.get(cmd.shard_id)
    if r is None:
        return _bad(f"shard {cmd.shard_id} is not frozen here")
    expected = t.fence.drop_next[cmd.shard_id]
    if cmd.part == expected - 1 and expected == SHARDS:
        return Removed(0)  # the last part again (a retried proposal): nothing is left
    if cmd.part != expected:
        return _bad(f"shard {cmd.shard_id}: drop part {expected} next, not {cmd.part}")
    c = t.col
    removed = 0
    for blocks in t.blocks:
        part = blocks.part(cmd.part)
        for key in [k for k in part if r.holds(key_of(k))]:
            s = part[key]
            while s != NIL:
                nxt = c.bnext[s]
                t._unlink_block(blocks, key, s)
                t._release(s)
                removed += 1
                s = nxt
    # The fence stays after the last part: a replica still routing by a map from
    # before the move would otherwise take writes in S here again, acknowledged
    # and then lost. Only a later import of the keys back lifts it (`_fence`).
    t.fence.drop_next[cmd.shard_id] = cmd.part + 1
    return Removed(removed)


__all__ = ["apply"]
