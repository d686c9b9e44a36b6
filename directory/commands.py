"""The replicated commands and their results, as plain data.

Every change to the directory is one of these commands, decided by the leader
(which stamps its clock reading into the command) and applied identically by
every replica. They carry no behaviour; `table.Table.apply` interprets them and
`codec` gives them an explicit, versioned byte form.

Ordering contract: a command is applied only after Raft commits it, and a
result is reported to the caller only after the local replica applied it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from kvdir.core.shard_map import ShardMap


class Tier(IntEnum):
    """Where a holder keeps a block (values match kvdir.v1.Tier)."""

    GPU = 1
    HOST = 2


@dataclass(frozen=True, slots=True)
class RegisterNode:
    node_id: str
    host: str
    endpoint: str
    transports: tuple[str, ...]
    incarnation: int
    lease_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    node_id: str
    incarnation: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class Publish:
    """A batch of (block, holder-record) entries from one node, one tier."""

    node_id: str
    incarnation: int
    namespace: str
    tier: int
    hashes: list[bytes]
    addresses: list[int]
    lengths: list[int]
    rkeys: list[int]
    generations: list[int]


@dataclass(frozen=True, slots=True)
class Remove:
    """Drop a node's records.

    Guards (each column empty = no guard): a record goes only if its generation
    is <= `generations[i]` and it is the slot at `addresses[i]`, so a remove that
    overtakes a re-publish of the block (same slot or another) does not undo it.
    """

    node_id: str
    incarnation: int
    namespace: str
    tier: int
    hashes: list[bytes]
    generations: list[int] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ClearNode:
    """Drop a node's records (in one namespace, or all); optionally forget it."""

    node_id: str
    incarnation: int
    namespace: str | None
    deregister: bool


@dataclass(frozen=True, slots=True)
class ExpireNodes:
    """Leader-proposed: drop these (node, incarnation)s if still expired at now_ms."""

    now_ms: int
    nodes: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Barrier:
    """A no-op whose commit proves the replica has applied everything before it."""


@dataclass(frozen=True, slots=True)
class SetShardMap:
    """The home group's shard map becomes `shard_map`, if the committed one is
    `expected_version` (0: none yet) and `shard_map.version` is the next one:
    a compare-and-set, so two operators' changes never silently overwrite."""

    expected_version: int
    shard_map: ShardMap


@dataclass(frozen=True, slots=True)
class FreezeShard:
    """Move, source group: from this log index no write in keys [lo, hi) applies."""

    shard_id: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class BeginImport:
    """Move, target group: keys [lo, hi) arrive by Import; clients' writes there wait
    for ImportDone."""

    shard_id: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Import:
    """Move, target group: one command of the source's log, applied to the shard's
    keys only (the importer filtered it to them)."""

    shard_id: int
    inner: Publish | Remove | ClearNode | ExpireNodes


@dataclass(frozen=True, slots=True)
class ImportDone:
    """Move, target group: everything up to the source's freeze is applied."""

    shard_id: int


@dataclass(frozen=True, slots=True)
class DropShard:
    """Move, source group: drop the frozen shard's entries in block-index part
    `part` (0..255, in order; a 256th of the table per command, so no apply
    holds the Raft thread long). The fence stays: a replica routing by an old
    map must still refuse the keys; a later BeginImport of them lifts it."""

    shard_id: int
    part: int


MoveCommand = FreezeShard | BeginImport | Import | ImportDone | DropShard

Command = (
    RegisterNode
    | Heartbeat
    | Publish
    | Remove
    | ClearNode
    | ExpireNodes
    | Barrier
    | SetShardMap
    | MoveCommand
)


class Reject(IntEnum):
    """Why a well-formed command was refused by the state machine."""

    UNKNOWN_NODE = 1
    STALE_INCARNATION = 2
    BAD_TIER = 3
    BAD_BATCH = 4
    STALE_SHARD_MAP = 5
    BAD_SHARD_MAP = 6
    SHARD_FENCED = 7
    BAD_MOVE = 8


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Reject
    message: str


@dataclass(frozen=True, slots=True)
class Registered:
    lease_expiry_ms: int
    lease_ms: int
    replaced_incarnation: bool


@dataclass(frozen=True, slots=True)
class Renewed:
    lease_expiry_ms: int


@dataclass(frozen=True, slots=True)
class Published:
    applied: int
    stale: int


@dataclass(frozen=True, slots=True)
class Removed:
    removed: int


@dataclass(frozen=True, slots=True)
class Expired:
    nodes: tuple[str, ...]
    removed: int


@dataclass(frozen=True, slots=True)
class Done:
    """Result of a Barrier."""


@dataclass(frozen=True, slots=True)
class ShardMapSet:
    """Result of a SetShardMap: the map now committed."""

    shard_map: ShardMap


Result = Rejected | Registered | Renewed | Published | Removed | Expired | Done | ShardMapSet
