"""The pysyncobj adapter through the consensus port: one real replica on loopback.

What the port promises beyond writes (apply listener order, capture at an
applied index, Status and Member values) checked against real pysyncobj.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdir.directory.commands import Barrier, Command, Publish, RegisterNode, Result
from kvdir.directory.consensus.port import Outcome, Role
from kvdir.directory.consensus.syncobj import RaftConsensus
from kvdir.directory.table import Table
from kvdir.local import free_ports, wait_for
from tests.unit.helpers import chain, publish_cmd

pytestmark = pytest.mark.integration


def test_one_replica_through_the_port(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    seen: list[tuple[int, Command, Result]] = []
    raft = RaftConsensus(addr, [], str(tmp_path))
    raft.add_apply_listener(lambda i, cmd, res: seen.append((i, cmd, res)))
    try:
        raft.wait_bound()
        wait_for(lambda: raft.status().role is Role.LEADER, 10.0, "a lone replica leads")
        reg = RegisterNode("n1", "host", "ep:1", ("tcp",), 1, 600_000, 0)
        first = raft.write(reg, 5.0)
        assert first.outcome is Outcome.COMMITTED and first.result == Table().apply(reg)
        pub = publish_cmd("n1", chain(3))
        assert raft.write(pub, 5.0).outcome is Outcome.COMMITTED
        assert raft.barrier(5.0).outcome is Outcome.COMMITTED
        st = raft.status()
        assert st.leader == addr and st.has_quorum and st.lag == 0
        assert [type(c) for _, c, _ in seen] == [RegisterNode, Publish, Barrier]
        indexes = [i for i, _, _ in seen]
        assert indexes == list(range(indexes[0], indexes[0] + 3))
        cap = raft.capture(5.0)
        assert cap.index == indexes[-1] == st.applied_index and cap.members == [addr]
        assert cap.image.meta["entries"] == 3
        assert [(m.address, m.is_self) for m in raft.members()] == [(addr, True)]
    finally:
        raft.close()
