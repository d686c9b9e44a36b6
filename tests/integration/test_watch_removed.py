"""A mirror leaves a removed replica that was left running, and catches up elsewhere.

docs/operations.md: a removed replica left running "sits without a leader,
NOT_SERVING". It applies nothing more, but its Watch stream went on sending
heartbeats, and a mirror following it stayed there for good, fresh by every
measure it has (the simulator found it: seeds 6868 and 8019). Real `kvdir
directory serve` processes, the real `kvdir ctl remove-replica`, a real
`MirrorSync` whose first address is the replica removed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.local import ClusterError, LocalCluster, wait_for
from tests.integration.helpers import register, status
from tests.integration.load import kvdir_ok

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_mirror_leaves_a_removed_replica_left_running(tmp_path: Path) -> None:
    cluster = LocalCluster(str(tmp_path), size=3)
    try:
        cluster.start(30)
        leader = cluster.wait_leader(10)
        gone = next(r for r in cluster.replicas if r is not leader)
        rest = [r.grpc_address for r in cluster.replicas if r is not gone]
        m = Mirror(max_staleness_s=2.0)
        with DirectoryClient(rest, timeout_s=10) as c, MirrorSync(m, [gone.grpc_address, *rest]):
            register(c, "before-removal")
            at = status(leader).applied_index
            wait_for(lambda: m.applied_index >= at, 10, f"the mirror to reach {at}")
            assert m.source == gone.replica_id
            # The removal is refused while the leader is not connected to the member
            # that stays (no quorum after it); a commit needs only one of the two, so
            # on a loaded host the other link may still be dialing here.
            wait_for(
                lambda: all(x.connected for x in status(leader).members),
                15,
                "the leader to be connected to every member",
                0.05,
            )
            out = kvdir_ok("ctl", "remove-replica", gone.raft_address, "--addr", ",".join(rest))
            assert f"removed {gone.raft_address}" in out
            cluster.mark_removed(gone)  # left running, as an operator may
            for i in range(5):
                register(c, f"after-removal-{i}")
            target = status(leader).commit_index
            try:
                wait_for(lambda: m.applied_index >= target, 15, f"the mirror at {target}", 0.05)
            except ClusterError:
                pytest.fail(f"the mirror stayed at {m.applied_index} on {m.source}, not {target}")
            assert m.source != gone.replica_id
            left = status(gone)
            assert left.applied_index < target and not left.leader_id, left
    finally:
        cluster.stop()
