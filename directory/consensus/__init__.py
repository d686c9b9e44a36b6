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

pysyncobj is imported by `_replica`, `transport`, `syncobj` and
`pysyncobj_log` only, never outside this package.
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
