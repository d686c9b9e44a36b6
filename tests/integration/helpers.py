"""Helpers of the integration tier: raw stubs, publishes and lookups on real replicas.

Everything here talks to real `kvdir directory serve` processes over gRPC on
127.0.0.1; every wait is a `wait_for` on a condition with a deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import grpc

from kvdir.core.client import DirectoryClient, namespace
from kvdir.local import LocalCluster, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

LONG_LEASE_MS = 600_000
"""Nodes of tests that are not about leases outlive the whole run."""

ADDRESS_BASE = 0x7F00_0000_0000
BLOCK_BYTES = 65_536
RKEY = 0x1234


def ns(model: str, block_tokens: int = 16) -> pb.Namespace:
    return namespace(model, block_tokens, "bf16", "vllm-paged")


def h(i: int, salt: int = 0) -> bytes:
    """Block hash number `i` (8 bytes); `salt` separates the chains of different tests."""
    return ((salt << 32) | i).to_bytes(8, "big")


def chain(n: int, salt: int = 0, start: int = 0) -> list[bytes]:
    return [h(i, salt) for i in range(start, start + n)]


def address_of(i: int) -> int:
    return ADDRESS_BASE + i * BLOCK_BYTES


def publish(
    c: DirectoryClient,
    node: str,
    incarnation: int,
    space: pb.Namespace,
    hashes: Sequence[bytes],
    tier: pb.Tier.ValueType = pb.TIER_GPU,
    generation: int = 1,
    first: int = 0,
) -> pb.PublishResponse:
    """Publish `hashes` as blocks `first`, `first + 1`, ... of `node`."""
    n = len(hashes)
    return c.publish(
        node,
        incarnation,
        space,
        tier,
        hashes,
        [address_of(first + k) for k in range(n)],
        [BLOCK_BYTES] * n,
        [RKEY] * n,
        [generation] * n,
    )


def register(
    c: DirectoryClient, node: str, incarnation: int = 1, lease_ms: int = LONG_LEASE_MS
) -> pb.RegisterNodeResponse:
    return c.register_node(
        node,
        "127.0.0.1",
        incarnation,
        f"127.0.0.1:{9000 + len(node)}",
        ["tcp", "shm"],
        lease_ms=lease_ms,
    )


def prefixes(resp: pb.LookupResponse) -> list[tuple[str, int]]:
    return [(m.node_id, m.prefix_blocks) for m in resp.matches]


def local_prefixes(
    c: DirectoryClient, r: Replica, space: pb.Namespace, hashes: Sequence[bytes]
) -> list[tuple[str, int]]:
    """What replica `r` answers from its own table, without a barrier."""
    resp = c.lookup(space, hashes, address=r.grpc_address, linearizable=False)
    assert resp.read.replica_id == r.replica_id
    assert not resp.read.linearizable
    return prefixes(resp)


def wait_local_prefixes(
    c: DirectoryClient,
    replicas: Sequence[Replica],
    space: pb.Namespace,
    hashes: Sequence[bytes],
    expected: list[tuple[str, int]],
    timeout_s: float = 5.0,
) -> None:
    """Wait until every replica's local lookup answers `expected`."""
    for r in replicas:
        _wait_local(c, r, space, hashes, expected, timeout_s)


def _wait_local(
    c: DirectoryClient,
    r: Replica,
    space: pb.Namespace,
    hashes: Sequence[bytes],
    expected: list[tuple[str, int]],
    timeout_s: float,
) -> None:
    wait_for(
        lambda: local_prefixes(c, r, space, hashes) == expected,
        timeout_s,
        f"{r.replica_id}'s local lookup to show {expected}",
    )


def live(cluster: LocalCluster) -> list[Replica]:
    return [r for r in cluster.replicas if r.alive]


def followers(cluster: LocalCluster) -> list[Replica]:
    leader = cluster.wait_leader(10)
    return [r for r in live(cluster) if r is not leader]


def wait_converged(
    cluster: LocalCluster, timeout_s: float = 10.0
) -> dict[str, pb.ClusterStatusResponse]:
    """Wait until every live replica answers with the same applied and commit index."""
    box: list[dict[str, pb.ClusterStatusResponse]] = []

    def converged() -> bool:
        st = cluster.statuses()
        if len(st) != len(live(cluster)):
            return False
        applied = {s.applied_index for s in st.values()}
        commits = {s.commit_index for s in st.values()}
        if len(applied) == 1 and applied == commits:
            box.append(st)
            return True
        return False

    wait_for(converged, timeout_s, "every live replica to apply the same index", 0.05)
    return box[-1]


@contextmanager
def raw_stub(address: str) -> Iterator[pb_grpc.PrefixDirectoryStub]:
    """A bare stub: no retries, no validation, whatever bytes the test wants to send."""
    with grpc.insecure_channel(address) as ch:
        yield pb_grpc.PrefixDirectoryStub(ch)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError `call` raises (failing the test if it succeeds)."""
    try:
        call()
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded; expected an RPC error")


def trailers(e: grpc.RpcError) -> dict[str, str]:
    """Trailing metadata of a failed call, values as text."""
    out: dict[str, str] = {}
    for item in e.trailing_metadata() or ():
        value = item.value
        out[item.key] = value.decode() if isinstance(value, bytes) else str(value)
    return out


def wait_all_serving(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Wait until every live replica answers ClusterStatus and names the same leader."""

    def serving() -> bool:
        st = cluster.statuses()
        leaders = {s.leader_id for s in st.values()}
        return len(st) == len(live(cluster)) and len(leaders) == 1 and "" not in leaders

    wait_for(serving, timeout_s, "every replica to answer and follow one leader", 0.05)


def status(r: Replica, timeout_s: float = 5.0) -> pb.ClusterStatusResponse:
    """Replica `r`'s own ClusterStatus (retried within `timeout_s`, never another replica's)."""
    with DirectoryClient([r.grpc_address], timeout_s=timeout_s) as c:
        return c.status(r.grpc_address)


def wait_all_connected(cluster: LocalCluster, timeout_s: float = 5.0) -> None:
    """Wait until every live replica sees every member connected.

    pysyncobj drops an idle follower-to-follower link and redials it, so one
    look can catch a link between the two.
    """

    def connected() -> bool:
        st = cluster.statuses()
        return len(st) == len(live(cluster)) and all(
            m.connected for s in st.values() for m in s.members
        )

    wait_for(connected, timeout_s, "every replica to see every member connected", 0.05)
