"""Raft timing, one place: what `[raft]` in a replica's config file sets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RaftTuning:
    """Raft timing for a 2-core, loopback-or-LAN cluster.

    pysyncobj's defaults batch appends every 100 ms (a write takes 100-200 ms).
    Sending appends immediately gives ~1 ms writes; 150-300 ms election
    timeouts with 30 ms heartbeats give sub-second failover.
    """

    append_entries_period_s: float = 0.03
    election_min_s: float = 0.15
    election_max_s: float = 0.3
    connection_timeout_s: float = 1.0
    leader_fallback_s: float = 1.0
    """A leader cut off from the majority steps down after this long."""
    tick_period_s: float = 0.01
    """How often the Raft thread wakes when no message arrives. pysyncobj's 50 ms
    quantised election timeouts so coarsely that both survivors of a leader
    kill often campaigned in the same tick and split the vote."""
    keepalive_s: float = 0.25
    """Every member pings every other this often (see `_onTick`)."""
    startup_grace_s: float = 1.0
    """A (re)starting replica waits this long for a leader before campaigning,
    so rejoining the cluster does not depose a healthy leader (no pre-vote)."""
    dns_cache_s: float = 10.0
    """How long a peer's resolved address is trusted. pysyncobj's 600 s kept a
    replica that came back on a new IP (a rescheduled pod) unreachable for 10 min."""
    compaction_min_entries: int = 20_000
    compaction_min_time_s: float = 600.0
    commands_queue_max: int = 20_000
