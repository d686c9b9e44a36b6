"""Losing a majority: rebuild the cluster from the one survivor, and fence off the old one.

Real processes. Two of three replicas die under a publish load and their
data is destroyed; the survivor is stopped and `kvdir directory recover`
rebuilds the state from its snapshot and whole journal (committed or not),
`kvdir directory restore` prepares the two replacements, and the new cluster
starts. What must survive: every acknowledged publish the survivor had
received. The writer is sequential, so that is every acknowledged block up
to the highest one in the survivor's log (Raft's log matching: holding an
entry means holding every entry before it). A stale copy of a lost replica's
data, started in its old place, is refused by the new cluster (cluster id).
"""

from __future__ import annotations

import functools
import shutil
import signal
import time
from pathlib import Path

import pytest

from kvdir.core.client import DirectoryClient, Unavailable
from kvdir.directory import backup, consensus
from kvdir.directory.commands import Publish
from kvdir.local import LocalCluster, Replica, wait_for
from tests.integration.helpers import (
    LONG_LEASE_MS,
    h,
    ns,
    publish,
    register,
    status,
    wait_all_serving,
    wait_converged,
)
from tests.integration.load import Load, kvdir, kvdir_ok, missing_on

pytestmark = pytest.mark.integration

NODE = "recovery-node"
SALT = 93
SPACE = ns("recovery/model")


def blocks_in_log(data_dir: str) -> set[int]:
    """Block numbers the load published that a stopped replica's journal holds."""
    want = {h(i, SALT): i for i in range(20_000)}
    out: set[int] = set()
    entries, _ = consensus.read_log(data_dir)
    for entry in entries:
        cmd = entry.command
        if isinstance(cmd, Publish):
            out.update(want[x] for x in cmd.hashes if x in want)
    return out


@pytest.mark.timeout(150)
def test_recover_from_a_lone_survivor(tmp_path: Path) -> None:
    cluster = LocalCluster(str(tmp_path / "cluster"), size=3)
    rec = str(tmp_path / "recovered.kvdb")
    stale_copy = str(tmp_path / "stale-data")
    try:
        cluster.start(30)
        wait_all_serving(cluster)
        with cluster.client(timeout_s=10) as c:
            register(c, NODE, lease_ms=LONG_LEASE_MS)
        load = Load(cluster.grpc_addresses, NODE, SPACE, SALT).start()
        load.wait_acked_after(0.0, 400, 20, "400 acknowledged publishes")

        # Disaster under load: the leader and one follower die, their disks with them.
        leader = cluster.wait_leader(10)
        lost = [leader, next(r for r in cluster.replicas if r is not leader)]
        survivor = next(r for r in cluster.replicas if r not in lost)
        for r in lost:
            cluster.kill(r)
        acked = load.finish()
        with (
            DirectoryClient([survivor.grpc_address], timeout_s=1.0) as c,
            pytest.raises(Unavailable),
        ):
            publish(c, NODE, 1, SPACE, [h(99_999, SALT)])
        shutil.copytree(lost[1].data_dir, stale_copy)  # "a disk that turns up later"
        for r in lost:
            shutil.rmtree(r.data_dir)
        # Never on a running replica's data dir (it holds a lock on it).
        res = kvdir(
            "directory", "recover", "--data-dir", survivor.data_dir,
            "--new-members", survivor.raft_address, "--out", rec,
        )  # fmt: skip
        assert res.returncode == 1 and "in use by another process" in res.stderr, res.stderr
        assert not Path(rec).exists()
        cluster.kill(survivor, signal.SIGTERM)

        held = blocks_in_log(survivor.data_dir)
        top = max(held)
        must_survive = [i for i in acked if i <= top]
        assert len(must_survive) >= 400
        maybe_lost = [i for i in acked if i > top]

        # Recover from the survivor, restore the replacements, start the new cluster.
        members = ",".join(r.raft_address for r in cluster.replicas)
        said = kvdir_ok(
            "directory", "recover", "--data-dir", survivor.data_dir,
            "--new-members", members, "--out", rec, "--replica-id", survivor.replica_id,
        )  # fmt: skip
        assert "old files kept in" in said
        header, _ = backup.load_backup(rec)
        assert header.kind == "recovery" and header.source_replica == survivor.replica_id
        for r in lost:
            kvdir_ok("directory", "restore", rec, "--data-dir", r.data_dir)
        cluster.start(30)
        wait_all_serving(cluster)
        cid = header.new_cluster_id()
        assert {status(r).cluster_id for r in cluster.replicas} == {cid}

        with cluster.client(timeout_s=10) as c:
            for r in cluster.replicas:
                shows = functools.partial(lambda r: missing_on(c, r, load, must_survive) == [], r)
                wait_for(shows, 20, f"{r.replica_id} to show {len(must_survive)} survivors' blocks")
            # The new cluster takes writes (node registrations survived too).
            publish(c, NODE, 1, SPACE, [h(50_000, SALT)])
        print(f"acknowledged {len(acked)}, survivor held up to {top}, lost {len(maybe_lost)}")

        # A stale disk of a lost replica, started in its old place with its old config,
        # is refused: it never joins, never leads, and the cluster keeps working.
        old: Replica = lost[1]
        cluster.kill(old, signal.SIGTERM)
        shutil.rmtree(old.data_dir)
        shutil.copytree(stale_copy, old.data_dir)
        cluster.launch(old)
        others = [r for r in cluster.replicas if r is not old]

        def refused() -> bool:  # logged by whichever side accepted the connection
            logs = "".join(Path(r.log_path).read_text() for r in cluster.replicas)
            return "refused a raft peer of another cluster" in logs

        wait_for(refused, 15, "the new cluster to refuse the stale replica", 0.1)
        t = time.monotonic()
        with cluster.client(timeout_s=10) as c:
            publish(c, NODE, 1, SPACE, [h(50_001, SALT)])
        st = status(old)
        assert st.leader_id == "" and st.cluster_id == ""
        seen = [m for r in others for m in status(r).members if m.raft_address == old.raft_address]
        assert len(seen) == 2 and not any(m.connected for m in seen)
        assert time.monotonic() - t < 10
    finally:
        cluster.stop()


@pytest.mark.timeout(120)
def test_recover_to_a_single_member_then_add_a_replica(tmp_path: Path) -> None:
    """The one-host path: the survivor alone becomes the cluster; replacements join later."""
    cluster = LocalCluster(str(tmp_path / "cluster"), size=3)
    rec = str(tmp_path / "single.kvdb")
    try:
        cluster.start(30)
        wait_all_serving(cluster)
        space = ns("recovery/single")
        with cluster.client(timeout_s=10) as c:
            register(c, NODE, lease_ms=LONG_LEASE_MS)
            for k in range(20):
                publish(c, NODE, 1, space, [h(k, SALT)], first=k)
        wait_converged(cluster)
        survivor, *lost = cluster.replicas
        for r in lost:
            cluster.kill(r)
            shutil.rmtree(r.data_dir)
            cluster.mark_removed(r)
        lost_peers = [f"{r.replica_id}={r.raft_address},{r.grpc_address}" for r in lost]
        stale_config = cluster.command(survivor) + [
            arg for p in lost_peers for arg in ("--peer", p)
        ]
        cluster.kill(survivor, signal.SIGTERM)
        kvdir_ok(
            "directory", "recover", "--data-dir", survivor.data_dir,
            "--new-members", survivor.raft_address, "--out", rec,
        )  # fmt: skip
        # Started on its old config (the lost peers still listed): the recovered
        # membership, one member, wins, so it leads alone.
        cluster.launch(survivor, stale_config)
        assert cluster.wait_leader(20) is survivor
        term = status(survivor).term
        r4 = cluster.new_replica()
        r4.extra_args = ["--join", "--cluster-id", backup.load_backup(rec)[0].new_cluster_id()]
        # 1 -> 2 needs the new member to commit the change: start it first, then add it.
        cluster.launch(r4)
        kvdir_ok("ctl", "add-replica", r4.raft_address, "--addr", survivor.grpc_address)
        with DirectoryClient([r4.grpc_address], timeout_s=10) as c:

            def r4_has_all() -> bool:
                try:
                    resp = c.lookup(space, [h(k, SALT) for k in range(20)], linearizable=False)
                except Unavailable:
                    return False
                return [(m.node_id, m.prefix_blocks) for m in resp.matches] == [(NODE, 20)]

            wait_for(r4_has_all, 30, "r4 to hold the 20 recovered blocks", 0.1)
        assert {m.raft_address for m in status(survivor).members} == {
            survivor.raft_address,
            r4.raft_address,
        }
        # The joiner never campaigned: the survivor kept its leadership and its term.
        assert cluster.wait_leader(10) is survivor
        assert status(r4).term == status(survivor).term == term
    finally:
        cluster.stop()
