"""Leader failure under a continuous write load: nothing acknowledged is lost."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvdir.core.client import (
    DirectoryClient,
    DirectoryError,
    OutcomeUnknown,
    Unavailable,
    records,
)
from kvdir.local import LocalCluster, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb
from tests.integration.helpers import address_of, h, live, ns, publish, register, status

pytestmark = pytest.mark.integration

NODE = "failover-node"
INCARNATION = 1
SALT = 77
SPACE = ns("failover/model")
PUBLISHES_MAX = 3000
WRITE_SECONDS_MAX = 20.0
ACKS_BEFORE_KILL = 300
ACKS_AFTER_ELECTION = 200
ACK_GAP_S_MAX = 5.0
ELECTION_S_MAX = 3.0
"""Loose: RaftTuning aims at sub-second failover (150-300 ms election timeouts)."""
LOOKUP_BATCH = 256


@dataclass
class WriterLog:
    """What the writer saw: only `acked` publishes were confirmed committed."""

    acked: list[tuple[int, float]] = field(default_factory=list)
    """(block number, monotonic time of the acknowledgement)."""
    unknown: list[int] = field(default_factory=list)
    unavailable: list[int] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    attempts: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def acked_after(self, t: float) -> int:
        return sum(1 for _, at in list(self.acked) if at > t)


def write_continuously(addresses: Sequence[str], stop: threading.Event, log: WriterLog) -> None:
    """Publish one new block per call until stopped, bounded in count and time."""
    deadline = time.monotonic() + WRITE_SECONDS_MAX
    try:
        with DirectoryClient(addresses, timeout_s=3.0, retry_unknown=False) as c:
            for i in range(PUBLISHES_MAX):
                if stop.is_set() or time.monotonic() >= deadline:
                    return
                log.attempts += 1
                try:
                    publish(c, NODE, INCARNATION, SPACE, [h(i, SALT)], first=i)
                except OutcomeUnknown:
                    log.unknown.append(i)
                except Unavailable:
                    log.unavailable.append(i)
                except DirectoryError as e:  # refused: a bug, not a failover effect
                    log.errors.append(e)
                    return
                else:
                    log.acked.append((i, time.monotonic()))
    except BaseException as e:
        log.errors.append(e)
    finally:
        log.done.set()


def missing_on(
    c: DirectoryClient, r: Replica, blocks: Sequence[int], linearizable: bool
) -> list[int]:
    """Blocks of `blocks` that replica `r` does not show as held by NODE (one-block lookups)."""
    missing: list[int] = []
    for start in range(0, len(blocks), LOOKUP_BATCH):
        part = blocks[start : start + LOOKUP_BATCH]
        lookups = [pb.LookupRequest(namespace=SPACE, block_hashes=[h(i, SALT)]) for i in part]
        resp = c.lookup_batch(lookups, linearizable=linearizable, address=r.grpc_address)
        assert resp.read.replica_id == r.replica_id
        for i, res in zip(part, resp.results, strict=True):
            got = [(m.node_id, m.prefix_blocks, records(m).addresses) for m in res.matches]
            if got != [(NODE, 1, [address_of(i)])]:
                missing.append(i)
    return missing


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_leader_failure_loses_no_acknowledged_write(cluster: LocalCluster, sig: int) -> None:
    with cluster.client(timeout_s=10) as c:
        register(c, NODE, INCARNATION)
    old = cluster.wait_leader(10)
    old_term = status(old).term

    log = WriterLog()
    stop = threading.Event()
    writer = threading.Thread(
        target=write_continuously, args=(cluster.grpc_addresses, stop, log), name="writer"
    )
    writer.start()
    try:
        wait_for(
            lambda: len(log.acked) >= ACKS_BEFORE_KILL or log.done.is_set(),
            15,
            f"{ACKS_BEFORE_KILL} acknowledged publishes before the kill",
        )
        assert not log.errors, log.errors
        assert len(log.acked) >= ACKS_BEFORE_KILL
        killed_at = time.monotonic()
        cluster.kill(old, sig)
        assert not old.alive
        down_at = time.monotonic()

        new = cluster.wait_leader(10)
        assert new is not old
        elected_s = time.monotonic() - down_at
        assert elected_s < ELECTION_S_MAX, f"a new leader took {elected_s:.2f}s"
        assert status(new).term > old_term
        # Writes succeed again under the new leader.
        wait_for(
            lambda: log.acked_after(killed_at) >= ACKS_AFTER_ELECTION or log.done.is_set(),
            15,
            f"{ACKS_AFTER_ELECTION} acknowledged publishes after the election",
        )
        assert log.acked_after(killed_at) >= ACKS_AFTER_ELECTION, (
            f"writer stopped after {log.attempts} attempts: {len(log.acked)} acked, "
            f"{len(log.unknown)} unknown, {len(log.unavailable)} unavailable"
        )
    finally:
        stop.set()
        writer.join(30)
    assert not writer.is_alive()
    assert not log.errors, log.errors

    acked = [i for i, _ in log.acked]
    times = [t for _, t in log.acked]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < ACK_GAP_S_MAX, f"longest gap between acknowledged writes {max(gaps):.2f}s"

    # Every acknowledged publish is on every live replica (linearizable reads).
    with cluster.client(timeout_s=10) as c:
        for r in live(cluster):
            assert missing_on(c, r, acked, linearizable=True) == [], r.replica_id

        # The killed replica comes back from its journal and catches up.
        target = max(s.applied_index for s in cluster.statuses().values())
        cluster.launch(old)

        def caught_up() -> bool:
            st = cluster.statuses().get(old.replica_id)
            return st is not None and st.applied_index >= target

        wait_for(caught_up, 20, f"{old.replica_id} to apply up to index {target}", 0.05)
        wait_for(
            lambda: missing_on(c, old, acked, linearizable=False) == [],
            10,
            f"{old.replica_id}'s local lookups to show all {len(acked)} acknowledged blocks",
            0.1,
        )

        # All three agree on one leader again and hold the same table.
        def whole() -> bool:
            st = cluster.statuses()
            leaders = {s.leader_id for s in st.values()}
            return (
                len(st) == 3
                and len(leaders) == 1
                and sum(s.role == pb.ROLE_LEADER for s in st.values()) == 1
                and len({(s.applied_index, s.entries, s.blocks) for s in st.values()}) == 1
            )

        wait_for(whole, 10, "all three replicas to agree on a leader and on the table", 0.05)
        assert status(old).entries >= len(acked)
