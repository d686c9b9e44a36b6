"""Encrypted Raft between real replica processes: the password is the membership.

Three replicas share one password and serve (the secure_cluster fixture writes
and reads through them in the other tests). Here a third replica started with
a wrong password must never join: the two good ones elect a leader and commit
writes while it learns nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvdir.core.client import DirectoryClient, DirectoryError, namespace
from kvdir.local import LocalCluster, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.security.conftest import Pki, directory_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NS = namespace("raft-password", 16)
OBSERVE_S = 3.0
"""How long the outsider is watched after the insiders committed (10+ heartbeats)."""


class _SplitPasswords(LocalCluster):
    """r3 holds a different password from r1 and r2."""

    wrong_password_file: str = ""

    def command(self, r: Replica) -> list[str]:
        cmd = super().command(r)
        if r.replica_id == "r3":
            i = cmd.index("--raft-password-file")
            cmd[i + 1] = self.wrong_password_file
        return cmd


def _entries(c: DirectoryClient, r: Replica) -> tuple[int, bool]:
    try:
        s = c.status(r.grpc_address)
    except DirectoryError:
        return -1, False
    return s.entries, s.has_quorum


def test_a_replica_with_the_wrong_password_cannot_join(tmp_path: Path, pki: Pki) -> None:
    wrong = os.path.join(pki.dir, "wrong.password")
    Path(wrong).write_text("not-the-cluster-password\n")
    c = _SplitPasswords(
        str(tmp_path),
        size=3,
        extra_args=directory_flags(pki),
        security=pki.leaves["admin"].client(),
    )
    c.wrong_password_file = wrong
    try:
        c.start(timeout_s=60)  # r1 + r2 are a majority: they elect a leader
        leader = c.wait_leader(30)
        assert leader.replica_id in ("r1", "r2")
        with c.client(timeout_s=10) as cl:
            cl.register_node("n1", "127.0.0.1", 1)
            cl.publish("n1", 1, NS, pb.TIER_HOST, [b"k" * 8], [4096], [4096], [1], [1])
            r1, r2, r3 = c.replicas
            wait_for(
                lambda: _entries(cl, r1)[0] == 1 and _entries(cl, r2)[0] == 1,
                30,
                "r1 and r2 to apply the publish",
            )
            deadline = time.monotonic() + OBSERVE_S
            while time.monotonic() < deadline:
                entries, quorum = _entries(cl, r3)
                assert entries == 0 and not quorum, "r3 decrypted the log without the password"
                time.sleep(0.1)
            st = cl.status(r3.grpc_address)
            assert st.leader_id == ""
            assert r3.alive, "a bad password must not crash the replica"
            assert all(m.connected is False for m in st.members if not m.is_self)
    finally:
        c.stop()
