"""After a start, a replica refuses local reads until it has caught up, once.

`kvdir chaos` measured restarted replicas answering local lookups from state
minutes old while they replayed (docs/chaos.md). The replica here is the in-process
consensus port (`consensus.memory`) with its applied and commit indexes set by
hand, because a real process's replay cannot be held at a chosen point; the
gRPC server, the service and the client are the real ones, over loopback.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvdir.core.client import DirectoryClient, OutcomeUnknown, Unavailable, namespace
from kvdir.directory.config import DirectoryConfig
from kvdir.directory.consensus.memory import MemoryCluster, MemoryReplica
from kvdir.directory.consensus.port import Status
from kvdir.directory.metrics import DirectoryMetrics
from kvdir.directory.server import DirectoryService, WallClock
from kvdir.local import free_ports
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

SPACE = namespace("catchup/model", 16)
LAG_MAX = 1000


class Replaying(MemoryReplica):
    """A replica part-way through replaying its journal: indexes and leader set by hand."""

    def __init__(self, applied: int, commit: int) -> None:
        super().__init__(MemoryCluster(), "127.0.0.1:1")
        self.raftLastApplied = applied
        self.raftCommitIndex = commit
        self.leader: str | None = None

    def status(self) -> Status:
        return dataclasses.replace(
            super().status(),
            leader=self.leader,
            applied_index=self.raftLastApplied,
            commit_index=self.raftCommitIndex,
        )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Replaying, str]]:
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    cfg = DirectoryConfig("r1", "127.0.0.1:1", addr, str(tmp_path))
    replica = Replaying(applied=10, commit=10 + LAG_MAX + 1)
    service = DirectoryService(cfg, replica, DirectoryMetrics(), WallClock())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PrefixDirectoryServicer_to_server(service, server)
    server.add_insecure_port(addr)
    server.start()
    try:
        yield replica, addr
    finally:
        server.stop(0).wait(5)


def test_local_reads_wait_until_the_replica_has_caught_up(served: tuple[Replaying, str]) -> None:
    replica, addr = served
    with DirectoryClient([addr], timeout_s=0.5) as c:
        # No leader heard yet: the replica cannot know how far behind it is.
        with pytest.raises(Unavailable, match="no leader heard yet"):
            c.lookup(SPACE, [b"\x00" * 8], address=addr)
        replica.leader = "127.0.0.1:1"
        with pytest.raises(Unavailable, match="catching up after start: 1001 committed entries"):
            c.lookup(SPACE, [b"\x00" * 8], address=addr)
        with pytest.raises(Unavailable, match="catching up"):
            c.lookup_batch([], address=addr)
        replica.raftLastApplied = replica.raftCommitIndex - LAG_MAX  # within the bound
        resp = c.lookup(SPACE, [b"\x00" * 8], address=addr)
        assert list(resp.matches) == []
        assert resp.read.commit_index - resp.read.applied_index == LAG_MAX
        # Caught up once: a later lag (a burst of writes) is reported, not refused.
        replica.raftCommitIndex += 10 * LAG_MAX
        replica.leader = None
        resp = c.lookup(SPACE, [b"\x00" * 8], address=addr)
        assert resp.read.commit_index - resp.read.applied_index == 11 * LAG_MAX
        assert c.lookup_batch([], address=addr).read.applied_index == replica.raftLastApplied


class RefuseThenHang:
    """Refuses the first call of each method, then holds every later one past the deadline."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.release = threading.Event()

    def answer(self, method: str, context: grpc.ServicerContext) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "catching up after start")
        self.release.wait(5)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        def method(name: str, request: type[Message]) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                lambda _req, ctx: self.answer(name, ctx),
                request_deserializer=request.FromString,
            )

        return grpc.method_handlers_generic_handler(
            "kvdir.v1.PrefixDirectory",
            {
                "Lookup": method("Lookup", pb.LookupRequest),
                "Publish": method("Publish", pb.PublishRequest),
            },
        )


def test_a_read_cut_by_its_deadline_is_unavailable_with_the_refusal_a_write_is_unknown() -> None:
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    servicer = RefuseThenHang()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((servicer.handler(),))
    server.add_insecure_port(addr)
    server.start()
    try:
        with DirectoryClient([addr], timeout_s=0.3) as c:
            # A read has no unknown outcome: the deadline cut its second attempt, and
            # the error names why the first was refused.
            with pytest.raises(Unavailable, match="catching up after start"):
                c.lookup(SPACE, [b"\x00" * 8], address=addr)
            # A write cut the same way may have committed.
            with pytest.raises(OutcomeUnknown):
                c.publish("n1", 1, SPACE, 1, [b"\x00" * 8], [0], [64], [1], [1])
        assert servicer.calls == {"Lookup": 2, "Publish": 2}
    finally:
        servicer.release.set()
        server.stop(0).wait(5)
