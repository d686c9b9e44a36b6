"""Every bound the directory enforces, in one place (units last in names).

A limit that is not here does not exist: queues, batches, chains and loops all
take their maximum from this module, so an operator can read the whole envelope
of the service on one page. Server-side overrides come from the config file;
the defaults are sized for a 2-core replica holding ~10M entries.
"""

from __future__ import annotations

from dataclasses import dataclass

HASH_BYTES_MAX = 32
"""Engines hash blocks to u64 (8 bytes) or to 32-byte digests."""

NODE_ID_BYTES_MAX = 128
HOST_BYTES_MAX = 256
ENDPOINT_BYTES_MAX = 256
TRANSPORTS_MAX = 8
TRANSPORT_NAME_BYTES_MAX = 32
NAMESPACE_FIELD_BYTES_MAX = 256

HOLDERS_PER_BLOCK_MAX = 64
"""(node, tier) holders kept per block; the oldest is replaced beyond this."""

LEASE_MS_MIN = 500
LEASE_MS_MAX = 600_000
LEASE_MS_DEFAULT = 10_000

EXPIRE_NODES_PER_COMMAND_MAX = 256
"""Nodes one ExpireNodes command may drop; more wait for the next sweep."""

COMMAND_BYTES_MAX = 8 * 1024 * 1024
"""A decoded Raft command larger than this is refused before it is proposed."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds the gRPC layer enforces (configurable per cluster)."""

    chain_blocks_max: int = 4096
    """Blocks in one lookup chain (4096 x 512 tokens = 2M tokens)."""
    batch_entries_max: int = 8192
    """Entries in one Publish or Remove."""
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
