"""A mirror never resumes by index into another cluster's log (issue 29, hole 7).

Real replicas, a real `MirrorSync`. The mirror follows cluster A to index
I_a; A is backed up earlier (at I_b < I_a), stopped, wiped and restored from
that backup (`kvdir directory restore`: a new cluster id) on the same ports,
and written to past I_a. Resuming by index, the mirror would apply the
restored cluster's commands after I_a on top of A's table and serve the blocks
written to A after the backup, which the restored cluster does not hold. Every
Watch event names its cluster, so the mirror forgets A's table and starts
again from a snapshot: it ends equal to the restored cluster.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.directory import backup
from kvdir.local import LocalCluster, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.integration.helpers import chain, ns, publish, raw_stub, register, wait_all_serving
from tests.integration.load import kvdir_ok

pytestmark = pytest.mark.integration

NODE = "mirror-restore-node"
SPACE = ns("mirror-restore/model")
BATCH = 64
WAIT_S = 30.0


def _state(address: str) -> pb.ClusterStatusResponse:
    with raw_stub(address) as stub:
        resp: pb.ClusterStatusResponse = stub.ClusterStatus(
            pb.ClusterStatusRequest(with_digest=True), timeout=5
        )
        return resp


def _publish_batches(cluster: LocalCluster, salt: int, batches: int) -> None:
    with cluster.client(timeout_s=10) as c:
        for b in range(batches):
            publish(c, NODE, 1, SPACE, chain(BATCH, salt, b * BATCH), first=b * BATCH)


def _mirror_equals(m: Mirror, address: str) -> bool:
    s = _state(address)
    with m.lock:
        return m.ready and m.applied_index == s.applied_index and m.table.digest() == s.state_digest


@pytest.mark.timeout(180)
def test_a_mirror_resyncs_from_a_snapshot_after_a_restore(tmp_path: Path) -> None:
    cluster = LocalCluster(str(tmp_path / "cluster"), size=3)
    out = str(tmp_path / "dir.kvdb")
    mirror = Mirror(max_staleness_s=60)
    sync = MirrorSync(mirror, cluster.grpc_addresses)
    try:
        cluster.start(30)
        wait_all_serving(cluster)
        with cluster.client(timeout_s=10) as c:
            register(c, NODE)
        _publish_batches(cluster, salt=1, batches=5)
        kvdir_ok("ctl", "backup", "--out", out, "--addr", ",".join(cluster.grpc_addresses))
        header, _ = backup.load_backup(out)
        _publish_batches(cluster, salt=2, batches=20)  # A only: not in the backup
        sync.start()
        leader = cluster.wait_leader(10)
        wait_for(lambda: _mirror_equals(mirror, leader.grpc_address), WAIT_S, "mirror = A")
        i_a = mirror.applied_index
        assert mirror.cluster_id == "" and i_a > header.index

        cluster.stop()
        for r in cluster.replicas:
            shutil.rmtree(r.data_dir)
            kvdir_ok("directory", "restore", out, "--data-dir", r.data_dir)
        cluster.start(30)
        wait_all_serving(cluster)
        # Past I_a, so a resume from I_a would be served from the restored log's history.
        batches = 0
        while _state(cluster.wait_leader(10).grpc_address).applied_index <= i_a + BATCH:
            _publish_batches(cluster, salt=3 + batches, batches=1)
            batches += 1
        leader = cluster.wait_leader(10)
        wait_for(lambda: _mirror_equals(mirror, leader.grpc_address), WAIT_S, "mirror = restored")
        assert mirror.cluster_id == header.new_cluster_id() != ""
        assert mirror.resyncs >= 1
        with cluster.client(timeout_s=10) as c:  # A's later blocks are gone from both
            resp = c.lookup(SPACE, chain(BATCH, 2), 8)
        assert list(resp.matches) == []
    finally:
        sync.stop()
        cluster.stop()
