"""A replica without a leader cuts its watchers off (`no-leader`), a failover does not.

A replica removed from the cluster but left running (docs/operations.md allows
it), or one cut off from its majority, applies nothing more, yet its idle
heartbeats kept a mirror on it, fresh, for good: the simulator's seeds 6868
and 8019 (tests/sim/test_raft_sim.py) ended with the mirror dozens of entries
behind the healed cluster, still following such a replica.
"""

from __future__ import annotations

from kvdir.core.mirror import Mirror
from kvdir.directory.commands import RegisterNode
from kvdir.directory.limits import WatchLimits
from kvdir.directory.watch_hub import CutOff, Watcher
from tests.unit.watch_helpers import LEADER, LocalReplica, connect

LIMITS = WatchLimits(heartbeat_ms=50, leaderless_cut_ms=200)
HEARTBEATS = LIMITS.leaderless_cut_ms // LIMITS.heartbeat_ms


class Clock:
    def __call__(self) -> float:
        return 0.0


def _heartbeats(replica: LocalReplica, w: Watcher, n: int) -> CutOff | None:
    """Up to `n` idle heartbeats; the cut-off if one came instead."""
    for _ in range(n):
        ev = replica.service.next_event(w, 0.0)
        if isinstance(ev, CutOff):
            return ev
        assert ev.WhichOneof("event") == "heartbeat"
    return None


def test_a_leaderless_replica_cuts_its_watcher_off_and_the_mirror_resumes() -> None:
    replica = LocalReplica(LIMITS)
    replica.write(RegisterNode("n1", "10.0.0.1", "10.0.0.1:1", ("tcp",), 1, 10_000, 0))
    mirror = Mirror(clock=Clock())
    s = connect(replica, mirror)
    assert s.drain() is None
    at = mirror.applied_index
    assert _heartbeats(replica, s.watcher, 10 * HEARTBEATS) is None  # a leader: never cut
    replica.cluster.elect(None)
    cut = _heartbeats(replica, s.watcher, 10 * HEARTBEATS)
    assert cut is not None and cut.reason == "no-leader"
    assert cut.resume_from == at
    assert replica.service.hub.cut_offs == 1
    s.close()
    replica.cluster.elect(LEADER)  # (another replica, in production: it has a leader)
    s = connect(replica, mirror)
    assert mirror.snapshots == 1  # resumed from its index, not a snapshot
    assert s.drain() is None


def test_a_failover_shorter_than_the_limit_cuts_no_one_off() -> None:
    replica = LocalReplica(LIMITS)
    mirror = Mirror(clock=Clock())
    s = connect(replica, mirror)
    for _ in range(5):
        replica.cluster.elect(None)
        assert _heartbeats(replica, s.watcher, HEARTBEATS - 1) is None
        replica.cluster.elect(LEADER)
        assert _heartbeats(replica, s.watcher, 1) is None  # the count starts over
    assert replica.service.hub.cut_offs == 0
    replica.cluster.elect(None)  # now for good: cut at exactly the limit
    assert _heartbeats(replica, s.watcher, HEARTBEATS - 1) is None
    cut = _heartbeats(replica, s.watcher, 1)
    assert cut is not None and cut.reason == "no-leader"
    assert "no leader for 200 ms" in cut.message
