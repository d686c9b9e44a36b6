"""A mirror whose stream turns out to be another cluster's log starts again from a snapshot.

Every Watch event carries the replica's cluster id (`kvdir directory restore`
gives a restored cluster a new one). Indexes of two clusters' logs name
different commands, so a mirror must never resume by index across clusters.
The real-process version (a restore between two streams) is
tests/integration/test_mirror_restore.py.
"""

from __future__ import annotations

import pytest

from kvdir.core.mirror import Mirror, Resync
from kvdir.directory.commands import Publish, RegisterNode
from tests.unit.watch_helpers import LocalReplica, connect

RESTORED = "r654-0c5f8a95daf1"


def _replica(cluster_id: str, salt: int, batches: int) -> LocalReplica:
    r = LocalReplica()
    r.cluster.cluster_id = cluster_id
    r.write(RegisterNode("n1", "h", "e", ("tcp",), 1, 60_000, 0))
    for b in range(batches):
        hs = [bytes([salt, b, i]) * 3 for i in range(16)]
        r.write(Publish("n1", 1, "ns", 1, hs, [b] * 16, [1] * 16, [2] * 16, [1] * 16))
    return r


def _follow(r: LocalReplica, m: Mirror) -> None:
    s = connect(r, m)
    try:
        assert s.drain() is None
    finally:
        s.close()


def test_a_resume_into_another_cluster_resyncs_from_a_snapshot() -> None:
    a, b = _replica("", 1, 5), _replica(RESTORED, 2, 20)
    m = Mirror()
    _follow(a, m)
    assert m.cluster_id == "" and m.table.digest() == a.table.digest()
    assert b.index > m.applied_index  # b's history covers a resume from m's index
    with pytest.raises(Resync, match=RESTORED):
        _follow(b, m)
    assert not m.ready and not m.fresh() and m.resume_index() == 0 and m.resyncs == 1
    _follow(b, m)  # from index 0: a snapshot of b's log
    assert m.cluster_id == RESTORED
    assert m.applied_index == b.index and m.table.digest() == b.table.digest()


def test_a_resume_answered_with_another_clusters_snapshot_takes_it() -> None:
    a, b = _replica("", 1, 5), _replica(RESTORED, 2, 20)
    m = Mirror()
    _follow(a, m)
    b.service.hub.reset(b.index)  # b's history no longer covers m's index: a snapshot
    _follow(b, m)
    assert m.cluster_id == RESTORED and m.resyncs == 1
    assert m.applied_index == b.index and m.table.digest() == b.table.digest()


def test_the_same_cluster_resumes_by_index() -> None:
    a = _replica(RESTORED, 1, 5)
    m = Mirror()
    _follow(a, m)
    snapshots = m.snapshots
    a.write(RegisterNode("n2", "h", "e", ("tcp",), 1, 60_000, 0))
    _follow(a, m)
    assert m.snapshots == snapshots and m.resyncs == 0 and m.applied_index == a.index
