"""What a moving shard's target imports from its source (docs/sharding.md,
"Re-sharding online"): the source's snapshot and later log commands, cut down
to the shard's keys. Pure: the orchestrator (`kvdir ctl shards move`) reads
the source's Watch, passes each piece through here and sends the result to
the target's ImportShard, where the state machine checks it again.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvdir.directory.commands import ClearNode, Command, ExpireNodes, Publish, Remove
from kvdir.directory.shard_fence import Range, key_of
from kvdir.directory.table import NIL, Table

IMPORT_BATCH_ENTRIES = 1024
"""Entries per imported Publish built from a snapshot (one Raft command each)."""

Importable = Publish | Remove | ClearNode | ExpireNodes


def snapshot_publishes(t: Table, r: Range, batch: int = IMPORT_BATCH_ENTRIES) -> Iterator[Publish]:
    """The entries of `t` whose keys `r` holds, as Publishes by their node's
    incarnation, namespace and tier, at most `batch` entries each."""
    c = t.col
    groups: dict[tuple[str, int, str, int], list[int]] = {}
    for ns, blocks in enumerate(t.blocks):
        for key, head in blocks.items():
            if not r.holds(key_of(key)):
                continue
            s = head
            while s != NIL:
                node = t.node_by_idx[c.node[s]]
                assert node is not None, "a slot of a forgotten node"
                group = (node.node_id, node.incarnation, t.ns_names[ns], c.tier[s])
                groups.setdefault(group, []).append(s)
                s = c.bnext[s]
    for (node_id, incarnation, ns_name, tier), slots in groups.items():
        for i in range(0, len(slots), batch):
            part = slots[i : i + batch]
            yield Publish(
                node_id,
                incarnation,
                ns_name,
                tier,
                [_key(c.key[s]) for s in part],
                [c.addr[s] for s in part],
                [c.length[s] for s in part],
                [c.rkey[s] for s in part],
                [c.gen[s] for s in part],
            )


def _key(k: bytes | None) -> bytes:
    assert k is not None
    return k


def within(cmd: Command, r: Range) -> Importable | None:
    """`cmd` cut down to the keys `r` holds (None: nothing of it concerns `r`).

    Node-wide deletions pass whole: the target applies them to `r`'s keys only.
    """
    match cmd:
        case Publish():
            keep = [i for i, h in enumerate(cmd.hashes) if r.holds(key_of(h))]
            if not keep:
                return None
            return Publish(
                cmd.node_id,
                cmd.incarnation,
                cmd.namespace,
                cmd.tier,
                [cmd.hashes[i] for i in keep],
                [cmd.addresses[i] for i in keep],
                [cmd.lengths[i] for i in keep],
                [cmd.rkeys[i] for i in keep],
                [cmd.generations[i] for i in keep],
            )
        case Remove():
            keep = [i for i, h in enumerate(cmd.hashes) if r.holds(key_of(h))]
            if not keep:
                return None
            gens, addrs = cmd.generations, cmd.addresses
            return Remove(
                cmd.node_id,
                cmd.incarnation,
                cmd.namespace,
                cmd.tier,
                [cmd.hashes[i] for i in keep],
                [gens[i] for i in keep] if gens else [],
                [addrs[i] for i in keep] if addrs else [],
            )
        case ClearNode() | ExpireNodes():
            return cmd
        case _:
            return None


__all__ = ["IMPORT_BATCH_ENTRIES", "snapshot_publishes", "within"]
