"""Every bound the directory enforces, in one place (units last in names).

Field sizes and the gRPC message bound are wire-wide and live in
kvdir/core/wire.py; everything the directory itself bounds is here.
A limit that is in neither place does not exist: queues, batches, chains and loops all
take their maximum from this module, so an operator can read the whole envelope
of the service on one page. Server-side overrides come from the config file;
the defaults are sized for a 2-core replica holding ~10M entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdir.core.wire import (
    GRPC_MESSAGE_BYTES_MAX,
    HASH_BYTES_MAX,
    NAMESPACE_FIELD_BYTES_MAX,
    NODE_ID_BYTES_MAX,
)

HOLDERS_PER_BLOCK_MAX = 64
"""(node, tier) holders kept per block; the oldest is replaced beyond this."""

LEASE_MS_MIN = 500
LEASE_MS_MAX = 600_000
LEASE_MS_DEFAULT = 10_000

EXPIRE_NODES_PER_COMMAND_MAX = 256
"""Nodes one ExpireNodes command may drop; more wait for the next sweep."""

COMMAND_BYTES_MAX = 8 * 1024 * 1024
"""Largest encoded Raft command: the codec asserts it before a command is proposed
and refuses a longer one when decoding (a corrupt or hostile log entry)."""

BATCH_ENTRIES_CEILING = 16_384
"""The most a cluster may configure as `batch_entries_max` (see the tie below)."""

PUBLISH_ENTRY_BYTES_MAX = 1 + HASH_BYTES_MAX + 8 + 4 + 4 + 8
"""One Publish entry in the codec: hash length, hash, address, length, rkey, generation."""

COMMAND_HEAD_BYTES_MAX = 64 + 3 * NAMESPACE_FIELD_BYTES_MAX + NODE_ID_BYTES_MAX
"""Everything in a Publish or Remove besides its entries (ids, namespace key, counts)."""

# The largest batch a replica can be configured to accept must encode within one
# command, and one command must fit in one gRPC message (backups, forwarding).
assert BATCH_ENTRIES_CEILING * PUBLISH_ENTRY_BYTES_MAX + COMMAND_HEAD_BYTES_MAX <= COMMAND_BYTES_MAX
assert COMMAND_BYTES_MAX <= GRPC_MESSAGE_BYTES_MAX

SHARD_MAP_BYTES_MAX = 2 * 1024 * 1024
"""A shard map's JSON form in a SetShardMap command (4,096 shards are ~0.5 MB);
a longer one is refused before it is proposed."""
assert SHARD_MAP_BYTES_MAX + 64 <= COMMAND_BYTES_MAX

JOURNAL_RECORD_BYTES_MAX = 2 * COMMAND_BYTES_MAX
"""A journal record's payload: one pysyncobj log entry (our command plus its
framing, or a membership change). A length field above this is damage."""
assert JOURNAL_RECORD_BYTES_MAX > COMMAND_BYTES_MAX + 64 * 1024

RAFT_VOTE_ID_BYTES_MAX = 400
"""A voted-for node id (pysyncobj's "host:port" Raft address) as stored in the
term file: a DNS name is at most 253 bytes, so any Raft address fits."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds the gRPC layer enforces (configurable per cluster)."""

    chain_blocks_max: int = 4096
    """Blocks in one lookup chain (4096 x 512 tokens = 2M tokens)."""
    batch_entries_max: int = 8192
    """Entries in one Publish or Remove (at most BATCH_ENTRIES_CEILING)."""
    lookup_batch_max: int = 256
    """Chains in one LookupBatch."""
    lookup_nodes_max: int = 64
    """Holder nodes one lookup may return."""
    lookup_nodes_default: int = 8
    write_timeout_ms: int = 5_000
    """Longest a write waits for commit when the caller set no deadline."""
    barrier_timeout_ms: int = 2_000
    inflight_writes_max: int = 1024
    """Writes waiting on Raft at once; beyond this a write gets RESOURCE_EXHAUSTED."""
    local_read_lag_max: int = 1000
    """After a start, a replica serves local reads only once it has heard a leader
    and applied to within this many entries of its commit index (replaying the
    journal): `kvdir chaos` measured restarted replicas answering from state
    minutes old otherwise. Checked until first met, then never again: later lag
    is what each read's ReadInfo reports."""


@dataclass(frozen=True, slots=True)
class WatchLimits:
    """Bounds of the Watch stream (directory/watch.py, directory/watch_hub.py).

    A watcher's buffer holds references to the same command bytes the history
    holds, so a replica's extra memory is about `history_bytes_max` plus the
    bookkeeping, whatever the number of watchers.
    """

    watchers_max: int = 16
    """Watch streams one replica serves at once (each holds a gRPC worker thread)."""
    buffer_entries_max: int = 65_536
    """Commands waiting to be sent to one watcher; past it the watcher is cut off."""
    buffer_bytes_max: int = 64 * 1024 * 1024
    """Encoded bytes of the commands waiting for one watcher; past it, cut off."""
    history_entries_max: int = 65_536
    """Recent commands kept for watchers that resume from an index (else a snapshot)."""
    history_bytes_max: int = 64 * 1024 * 1024
    event_entries_max: int = 1024
    """Commands in one WatchEntries message."""
    event_bytes_max: int = 4 * 1024 * 1024
    """Encoded commands in one WatchEntries message (a bigger single command goes alone)."""
    heartbeat_ms: int = 50
    """An idle stream sends a heartbeat this often (carrying the commit index)."""
    snapshot_chunk_bytes: int = 1024 * 1024
    stalled_cancel_ms: int = 5_000
    """A watcher cut off while its stream is blocked (the reader stopped reading and
    flow control stopped the sends) gets this long to read on and see its status;
    then the call is cancelled, so a hung reader never holds a worker thread."""
    snapshots_inflight_max: int = 2
    """Snapshots being captured and streamed at once (each copies the table's columns)."""
    snapshot_share_ms: int = 500
    """Watch starts within this long of a capture share it (and its one copy of the
    columns): a fleet of mirrors restarting together costs one capture. Far shorter
    than the history lasts under load, so the shared capture's index is still covered."""
    leaderless_cut_ms: int = 1_000
    """A replica that has had no leader for this long (counted in idle heartbeats)
    cuts its watchers off (`no-leader`): one removed from the cluster but left
    running, or cut off from its majority, sends heartbeats at an index the others
    passed long ago, and its mirrors would stay there looking fresh. Longer than an
    election (150-300 ms), so a failover alone cuts no one off."""


# One command always fits one event, and one event one gRPC message.
assert COMMAND_BYTES_MAX <= GRPC_MESSAGE_BYTES_MAX - 1024
assert WatchLimits().snapshot_chunk_bytes + 1024 <= GRPC_MESSAGE_BYTES_MAX
