"""Consensus for the directory: one port, two implementations.

- `port`: the verbs and value types the server, daemon, admin and backups use
  (`Consensus`, `Status`, `Member`, `Capture`, `WriteResult`, `Outcome`, `Role`).
- `memory`: an in-process implementation (N replicas, no sockets, no threads,
  deterministic) for unit tests and simulation.
- `syncobj`: `RaftConsensus`, the production implementation; it holds
  the private `_replica.Replica` (a pysyncobj SyncObj with kvdir's safety
  fixes from `fixes`) over `transport.FencedTransport`.
- `pysyncobj_log`: a stopped replica's journal and snapshot anchors, offline
  (backups and recovery).
- `membership`: Raft addresses, the cluster id and the data dir lock;
  `tuning`: Raft timing (`[raft]` in the config).

The log's storage is kvdir's own; pysyncobj keeps only the protocol:

- `sync`: how bytes reach stable storage (the injected fsync policy) and the
  durability modes.
- `records`: the journal's record format and the scan that tells a torn tail
  from corruption (pure: bytes in, entries out).
- `journal`: the append-only log file (group commit, torn tail cut on open).
- `votes`: current term and vote (and the commit index), durable before use.
- `acks`: a follower's append answers, held until what they cover is durable.
- `pysyncobj_journal`: pysyncobj's journal interface over `journal` and
  `votes` (its `createJournal` hook, migration of pysyncobj's own files);
  `durable`: the SyncObj subclass that acknowledges only what is durable.

pysyncobj is imported by `_replica`, `transport`, `syncobj`, `pysyncobj_log`,
`pysyncobj_journal` and `durable` only, never outside this package.
"""

from kvdir.directory.consensus.port import (
    Capture,
    Consensus,
    LogError,
    Member,
    Outcome,
    Role,
    Status,
    WriteResult,
)
from kvdir.directory.consensus.pysyncobj_log import DATA_FILES, LogEntry, anchors, read_log

__all__ = [
    "DATA_FILES",
    "Capture",
    "Consensus",
    "LogEntry",
    "LogError",
    "Member",
    "Outcome",
    "Role",
    "Status",
    "WriteResult",
    "anchors",
    "read_log",
]
