"""The agent's publisher: coalescing, dropping, batching, requeue and session upkeep.

`FakeDirectory` is a test double for `directory.client.DirectoryClient`: it
records every call in order (and applies publishes and removes to a plain
dict so a test can compare end states) and can be told to fail a method with
a given `DirectoryError`. No sockets. The loop-level tests start the
publisher's real threads and wait on the double's record with deadlines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.agent.publisher import Holding, NodeIdentity, Publisher, PublisherLimits
from kvdir.core.client import DirectoryClient, DirectoryError, Unavailable, namespace
from kvdir.local import wait_for
from kvdir.v1 import directory_pb2 as pb

NS = namespace("pub-model", 16)
NS2 = namespace("pub-model-2", 16)
TIER = pb.TIER_HOST
NODE = NodeIdentity("node-p", "127.0.0.1", "127.0.0.1:7301", ("tcp", "shm"), lease_ms=3000)


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


@dataclass
class Call:
    method: str
    incarnation: int
    model: str = ""
    hashes: tuple[bytes, ...] = ()
    generations: tuple[int, ...] = ()
    addresses: tuple[int, ...] = ()
    deregister: bool = False


@dataclass
class FakeDirectory:
    """Test double for DirectoryClient (see the module docstring)."""

    node: NodeIdentity = NODE
    calls: list[Call] = field(default_factory=list)
    failures: dict[str, list[DirectoryError]] = field(default_factory=dict)
    held: dict[tuple[str, bytes], int] = field(default_factory=dict)
    """(model, hash) -> generation the directory would now hold."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, method: str, *errors: DirectoryError) -> None:
        with self.lock:
            self.failures.setdefault(method, []).extend(errors)

    def _record(self, call: Call) -> None:
        with self.lock:
            pending = self.failures.get(call.method)
            if pending:
                self.calls.append(Call("failed-" + call.method, call.incarnation, call.model))
                raise pending.pop(0)
            self.calls.append(call)

    def of(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]

    def register_node(
        self,
        node_id: str,
        host: str,
        incarnation: int,
        endpoint: str = "",
        transports: Sequence[str] = (),
        lease_ms: int = 0,
    ) -> pb.RegisterNodeResponse:
        n = self.node
        assert (node_id, host, endpoint, tuple(transports), lease_ms) == (
            n.node_id,
            n.host,
            n.endpoint,
            n.transports,
            n.lease_ms,
        )
        self._record(Call("register", incarnation))
        return pb.RegisterNodeResponse()

    def heartbeat(self, node_id: str, incarnation: int) -> pb.HeartbeatResponse:
        self._record(Call("heartbeat", incarnation))
        return pb.HeartbeatResponse()

    def publish(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        addresses: Sequence[int],
        lengths: Sequence[int],
        rkeys: Sequence[int],
        generations: Sequence[int],
    ) -> pb.PublishResponse:
        assert node_id == NODE.node_id
        assert tier == TIER
        assert len(hashes) == len(addresses) == len(lengths) == len(rkeys) == len(generations)
        self._record(
            Call(
                "publish",
                incarnation,
                ns.model,
                tuple(hashes),
                tuple(generations),
                tuple(addresses),
            )
        )
        with self.lock:
            for bh, g in zip(hashes, generations, strict=True):
                self.held[(ns.model, bh)] = g
        return pb.PublishResponse()

    def remove(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        generations: Sequence[int] = (),
        addresses: Sequence[int] = (),
    ) -> pb.RemoveResponse:
        assert node_id == NODE.node_id
        assert not addresses or len(addresses) == len(hashes)
        self._record(Call("remove", incarnation, ns.model, tuple(hashes), tuple(generations)))
        with self.lock:
            for bh, g in zip(hashes, generations, strict=True):
                if self.held.get((ns.model, bh)) == g:
                    del self.held[(ns.model, bh)]
        return pb.RemoveResponse()

    def clear_node(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace | None = None,
        deregister: bool = False,
    ) -> pb.ClearNodeResponse:
        self._record(Call("clear", incarnation, deregister=deregister))
        return pb.ClearNodeResponse()


@dataclass
class Holdings:
    """What the pool headers say is stored (the resync source)."""

    items: dict[str, list[Holding]] = field(default_factory=dict)

    def __call__(self) -> Iterable[tuple[pb.Namespace, int, list[Holding]]]:
        spaces = {NS.model: NS, NS2.model: NS2}
        return [(spaces[m], TIER, list(v)) for m, v in self.items.items()]


class Incarnations:
    def __init__(self, start: int = 1000) -> None:
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next


def make(
    fake: FakeDirectory | None = None,
    holdings: Holdings | None = None,
    **limits: float,
) -> tuple[Publisher, FakeDirectory]:
    fake = fake or FakeDirectory()
    lim = PublisherLimits(
        pending_max=int(limits.get("pending_max", 1000)),
        batch_entries_max=int(limits.get("batch_entries_max", 100)),
        batch_window_s=limits.get("batch_window_s", 0.0),
        resync_interval_s=limits.get("resync_interval_s", 300.0),
        retry_backoff_s=limits.get("retry_backoff_s", 0.0),
    )
    pub = Publisher(
        cast("DirectoryClient", fake), NODE, holdings or Holdings(), lim, Incarnations()
    )
    return pub, fake


def store(pub: Publisher, hashes: list[int], gen: int = 1, ns: pb.Namespace = NS) -> None:
    n = len(hashes)
    pub.stored(
        ns, TIER, [h(i) for i in hashes], [0x1000 * i for i in hashes], [64] * n, [9] * n, [gen] * n
    )


def remove(pub: Publisher, hashes: list[int], gen: int = 1, ns: pb.Namespace = NS) -> None:
    pub.removed(ns, TIER, [h(i) for i in hashes], [gen] * len(hashes), [0] * len(hashes))


def flush(pub: Publisher) -> None:
    """Run one turn of the loop's send step on the caller's thread."""
    pub._send(pub._take())


def unavailable() -> DirectoryError:
    return Unavailable(grpc.StatusCode.UNAVAILABLE, "directory unavailable after retries")


# ------------------------------------------------------------ coalescing


def test_a_store_then_a_remove_of_one_block_leaves_the_remove() -> None:
    pub, fake = make()
    pub.incarnation = 7
    store(pub, [1, 2])
    remove(pub, [1])
    assert pub.queue_depth == 2
    flush(pub)
    assert sorted((c.method, c.hashes, c.incarnation) for c in fake.calls) == [
        ("publish", (h(2),), 7),
        ("remove", (h(1),), 7),
    ]
    assert pub.queue_depth == 0
    assert (pub.published, pub.removed_count) == (1, 1)


def test_the_latest_generation_of_a_block_wins() -> None:
    pub, fake = make()
    store(pub, [5], gen=1)
    remove(pub, [5], gen=1)
    store(pub, [5], gen=2)
    flush(pub)
    (call,) = fake.calls
    assert (call.method, call.hashes, call.generations) == ("publish", (h(5),), (2,))


def test_namespaces_are_published_apart() -> None:
    pub, fake = make()
    store(pub, [1], ns=NS)
    store(pub, [1], ns=NS2)  # the same hash in another namespace is another block
    assert pub.queue_depth == 2
    flush(pub)
    assert sorted((c.model, c.hashes) for c in fake.of("publish")) == [
        (NS.model, (h(1),)),
        (NS2.model, (h(1),)),
    ]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=40
    ),
    batch_max=st.integers(1, 8),
)
def test_coalescing_sends_each_block_once_with_its_last_change(
    ops: list[tuple[bool, int, int]], batch_max: int
) -> None:
    pub, fake = make(batch_entries_max=batch_max)
    last: dict[bytes, tuple[bool, int]] = {}
    for is_store, i, gen in ops:
        (store if is_store else remove)(pub, [i], gen)
        last[h(i)] = (is_store, gen)
    assert pub.queue_depth == len(last)
    flush(pub)
    sent: dict[bytes, tuple[bool, int]] = {}
    for c in fake.calls:
        assert len(c.hashes) <= batch_max
        for bh, g in zip(c.hashes, c.generations, strict=True):
            assert bh not in sent, "a block was sent twice in one batch"
            sent[bh] = (c.method == "publish", g)
    assert sent == last
    assert pub.queue_depth == 0


# --------------------------------------------------------------- dropping


def test_a_full_queue_drops_new_blocks_and_schedules_a_resync() -> None:
    pub, _ = make(pending_max=3)
    store(pub, [1, 2, 3, 4, 5])
    assert (pub.queue_depth, pub.dropped) == (3, 2)
    assert pub._resync.is_set()
    # A change to a block already pending is no drop: it replaces the pending one.
    remove(pub, [2])
    assert (pub.queue_depth, pub.dropped) == (3, 2)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40),
    pending_max=st.integers(1, 6),
)
def test_drops_are_counted_exactly(ops: list[tuple[bool, int]], pending_max: int) -> None:
    pub, _ = make(pending_max=pending_max)
    pending: set[int] = set()
    dropped = 0
    for is_store, i in ops:
        (store if is_store else remove)(pub, [i])
        if i not in pending and len(pending) >= pending_max:
            dropped += 1
        else:
            pending.add(i)
    assert pub.dropped == dropped
    assert pub.queue_depth == len(pending)
    assert pub._resync.is_set() == (dropped > 0)


# --------------------------------------------------------------- batching


def test_batches_are_cut_at_batch_entries_max() -> None:
    pub, fake = make(batch_entries_max=4)
    store(pub, list(range(10)))
    flush(pub)
    assert [len(c.hashes) for c in fake.of("publish")] == [4, 4, 2]
    assert sorted(b for c in fake.calls for b in c.hashes) == [h(i) for i in range(10)]


# ---------------------------------------------------------------- requeue


def test_a_failed_batch_is_requeued_and_a_newer_change_wins() -> None:
    pub, fake = make()
    store(pub, [1, 2], gen=1)
    remove(pub, [3, 4], gen=1)
    batch = pub._take()
    fake.fail("remove", unavailable())
    with pytest.raises(DirectoryError):
        pub._send(batch)
    # The publishes went out; only the unsent removes are left in the batch.
    assert {k[2] for k in batch} == {h(3), h(4)}
    store(pub, [3], gen=2)  # newer than the failed remove of 3
    pub._requeue(batch)
    assert pub.queue_depth == 2
    flush(pub)
    assert fake.held == {(NS.model, h(1)): 1, (NS.model, h(2)): 1, (NS.model, h(3)): 2}
    assert [c.hashes for c in fake.of("remove")] == [(h(4),)]


def test_a_failure_is_retried_by_the_loop() -> None:
    pub, fake = make()
    fake.fail("publish", unavailable(), unavailable())
    pub.start()
    try:
        store(pub, [1, 2, 3])
        wait_for(lambda: len(fake.of("publish")) >= 1, 10, "the publish to go through")
        assert pub.failures == 2
        assert fake.held == {(NS.model, h(i)): 1 for i in (1, 2, 3)}
        assert pub.queue_depth == 0
    finally:
        pub.stop(deregister=False)


@pytest.mark.parametrize(
    ("reason", "new_incarnation"), [("unknown-node", False), ("stale-incarnation", True)]
)
def test_losing_the_session_re_registers_and_resyncs(reason: str, new_incarnation: bool) -> None:
    holdings = Holdings({NS.model: [(h(9), 0x9000, 64, 9, 3)]})
    pub, fake = make(holdings=holdings)
    pub.register(new_incarnation=True)
    first = pub.incarnation
    store(pub, [1])
    batch = pub._take()
    fake.fail("publish", DirectoryError(grpc.StatusCode.FAILED_PRECONDITION, "gone", reason))
    with pytest.raises(DirectoryError) as err:
        pub._send(batch)
    pub._on_failure(err.value, batch)
    assert [c.incarnation for c in fake.of("register")] == [first, pub.incarnation]
    assert (pub.incarnation != first) is new_incarnation
    assert pub.queue_depth == 1  # the failed change is waiting again
    assert pub._resync.is_set()  # and a full re-publish is due
    assert pub.connected
    assert pub.resync() == 1
    flush(pub)
    assert fake.held == {(NS.model, h(9)): 3, (NS.model, h(1)): 1}
    assert {c.incarnation for c in fake.of("publish")} == {pub.incarnation}


# ---------------------------------------------------------------- the loop


def test_start_registers_publishes_holdings_and_stop_deregisters() -> None:
    holdings = Holdings({NS.model: [(h(i), 0x1000 * i, 64, 9, 1) for i in range(250)]})
    pub, fake = make(holdings=holdings, batch_entries_max=100)
    pub.start()
    try:
        assert fake.calls[0] == Call("register", pub.incarnation)
        # The initial resync went out in batch_entries_max pieces.
        assert [len(c.hashes) for c in fake.of("publish")] == [100, 100, 50]
        assert pub.resyncs == 1
        store(pub, [1000])
        wait_for(lambda: (NS.model, h(1000)) in fake.held, 10, "a stored block to be published")
    finally:
        pub.stop(deregister=True)
    assert [c for c in fake.calls if c.method != "heartbeat"][-1] == Call(
        "clear", pub.incarnation, deregister=True
    )
    assert len(fake.held) == 251


def test_drops_are_repaired_by_a_resync_from_the_headers() -> None:
    holdings = Holdings()
    pub, fake = make(holdings=holdings, pending_max=2)
    pub.start()
    try:
        holdings.items[NS.model] = [(h(i), 0x1000 * i, 64, 9, 1) for i in range(6)]
        store(pub, list(range(6)))  # 4 of 6 dropped
        assert pub.dropped == 4
        wait_for(lambda: pub.resyncs >= 2, 10, "the resync a drop schedules")
        wait_for(lambda: len(fake.held) == 6, 10, "every block to be published")
    finally:
        pub.stop(deregister=False)


def test_heartbeats_renew_the_lease_and_recover_an_expired_session() -> None:
    node = NodeIdentity(NODE.node_id, NODE.host, NODE.endpoint, NODE.transports, lease_ms=300)
    fake = FakeDirectory(node=node)
    pub = Publisher(
        cast("DirectoryClient", fake),
        node,
        Holdings(),
        PublisherLimits(batch_window_s=0.0, retry_backoff_s=0.0),
        Incarnations(),
    )
    pub.start()
    try:
        wait_for(lambda: len(fake.of("heartbeat")) >= 2, 10, "heartbeats")
        inc = pub.incarnation
        assert {c.incarnation for c in fake.of("heartbeat")} == {inc}
        fake.fail(
            "heartbeat",
            DirectoryError(grpc.StatusCode.FAILED_PRECONDITION, "expired", "unknown-node"),
        )
        wait_for(lambda: len(fake.of("register")) >= 2, 10, "a re-register after expiry")
        assert pub.incarnation == inc  # unknown-node keeps the incarnation
        wait_for(lambda: pub.resyncs >= 2, 10, "a full re-publish after re-registering")
        wait_for(lambda: pub.connected, 10, "the session to be back")
    finally:
        pub.stop(deregister=False)


def test_parts_a_sharded_directory_committed_are_not_requeued() -> None:
    """A sharded client's failed publish names the positions whose groups committed
    their part: only the others go back to the queue."""
    pub, fake = make()
    store(pub, [1, 2, 3, 4], gen=1)
    batch = pub._take()
    sent = [k[2] for k in batch]
    err = unavailable()
    err.committed = (0, 2)  # the groups of the 1st and 3rd blocks took theirs
    fake.fail("publish", err)
    with pytest.raises(DirectoryError):
        pub._send(batch)
    assert {k[2] for k in batch} == {sent[1], sent[3]}
