"""The background threads the phases run next to their measurement.

`Heartbeats` keeps the benchmark nodes' leases alive; `Writer` publishes fresh
chains back to back (the leader-kill and compaction phases watch its acks);
`StatusWatch` polls every replica's ClusterStatus; `Prober` times light
lookups on every replica. Each runs at most `max_s` and stops on `finish()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc

from bench.directory.cluster import LOOKUP, NAMESPACE, Bench
from bench.measure import deadline_loop
from bench.shape import TIER, writer_hashes
from bench.workers import channel, raw_method
from kvdir.core.client import DirectoryClient, DirectoryError
from kvdir.v1 import directory_pb2 as pb

HEARTBEAT_S = 2.0
WRITER_NODE = "bench-writer"
WRITER_BATCH = 16
WRITER_BATCHES_MAX = 2_000_000


class Heartbeats(threading.Thread):
    """Keeps every benchmark node's lease alive for the whole run."""

    def __init__(
        self, addresses: Sequence[str], nodes: Sequence[str], incarnation: int, max_s: float
    ) -> None:
        super().__init__(name="bench-heartbeats", daemon=True)
        self.addresses, self.nodes, self.incarnation = list(addresses), list(nodes), incarnation
        self.stop_ev = threading.Event()
        self.max_s = max_s
        self.errors = 0

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        with DirectoryClient(self.addresses, timeout_s=2.0) as c:
            while not self.stop_ev.wait(HEARTBEAT_S) and time.monotonic() < end:
                for n in self.nodes:
                    try:
                        c.heartbeat(n, self.incarnation)
                    except DirectoryError:
                        self.errors += 1


class Writer(threading.Thread):
    """Publishes fresh 16-block chains back to back through the product client.

    `acks` holds (sent, acknowledged, seq) in time.monotonic(); a publish that
    fails after the client's own retries is retried with the same blocks.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        incarnation: int,
        first_seq: int,
        max_batches: int,
        max_s: float,
    ) -> None:
        super().__init__(name="bench-writer", daemon=True)
        self.addresses = list(addresses)
        self.incarnation = incarnation
        self.seq = first_seq
        self.max_batches, self.max_s = max_batches, max_s
        self.acks: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.unacked: list[int] = []
        """Seqs that failed and were not retried before the writer stopped."""
        self.stop_ev = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        last = self.seq + self.max_batches
        lengths, rkeys, gens = [65536] * WRITER_BATCH, [7] * WRITER_BATCH, [1] * WRITER_BATCH
        with DirectoryClient(self.addresses, timeout_s=5.0) as c:
            failed = False
            while not self.stop_ev.is_set() and time.monotonic() < end and self.seq < last:
                hs = writer_hashes(self.seq, WRITER_BATCH)
                addrs = [
                    (0x7E00 << 32) + (self.seq * WRITER_BATCH + i) * 65536
                    for i in range(WRITER_BATCH)
                ]
                t0 = time.monotonic()
                try:
                    c.publish(
                        WRITER_NODE,
                        self.incarnation,
                        NAMESPACE,
                        TIER,
                        hs,
                        addrs,
                        lengths,
                        rkeys,
                        gens,
                    )
                except DirectoryError as e:
                    self.errors.append(f"{time.monotonic() - t0:.2f}s {e.code.name}: {e}")
                    failed = True
                    continue
                self.acks.append((t0, time.monotonic(), self.seq))
                self.seq += 1
                failed = False
            if failed:
                self.unacked.append(self.seq)

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=30)


class StatusWatch(threading.Thread):
    """Polls every replica's ClusterStatus: (time, replica, term, leader, log length,
    last compaction s)."""

    def __init__(
        self,
        statuses: Callable[[], dict[str, pb.ClusterStatusResponse]],
        max_s: float,
        interval_s: float = 0.1,
    ) -> None:
        super().__init__(name="bench-status-watch", daemon=True)
        self.statuses, self.max_s, self.interval_s = statuses, max_s, interval_s
        self.polls: list[tuple[float, str, int, str, int, float]] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self.stop_ev.wait(self.interval_s) and time.monotonic() < end:
            now = time.monotonic()
            for rid, s in self.statuses().items():
                self.polls.append(
                    (now, rid, s.term, s.leader_id, s.log_entries, s.last_compaction_s)
                )

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=10)


class Prober(threading.Thread):
    """Light sequential lookups round-robin over replicas: (time, replica, latency)."""

    def __init__(self, addresses: dict[str, str], request: bytes, max_s: float) -> None:
        super().__init__(name="bench-prober", daemon=True)
        self.addresses, self.request, self.max_s = addresses, request, max_s
        self.samples: list[tuple[float, str, float]] = []
        self.errors = 0
        self.stop_ev = threading.Event()

    def run(self) -> None:
        chans = {rid: channel(a) for rid, a in self.addresses.items()}
        calls = {rid: raw_method(c, LOOKUP, "LookupResponse") for rid, c in chans.items()}
        end = time.monotonic() + self.max_s
        try:
            while not self.stop_ev.wait(0.005) and time.monotonic() < end:
                for rid, call in calls.items():
                    t0 = time.monotonic()
                    try:
                        call(self.request, timeout=5.0)
                    except grpc.RpcError:
                        self.errors += 1
                        continue
                    self.samples.append((t0, rid, time.monotonic() - t0))
        finally:
            for c in chans.values():
                c.close()

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=10)


def start_writer(b: Bench, max_s: float) -> Writer:
    w = Writer(
        b.cluster.grpc_addresses,
        b.incarnation,
        b.writer_seq,
        max_batches=WRITER_BATCHES_MAX,
        max_s=max_s,
    )
    w.start()
    return w


def retire_writer(b: Bench, w: Writer) -> None:
    """Stop `w` and keep what it wrote for the verification phase."""
    w.finish()
    b.writer_acked += [seq for _, _, seq in w.acks]
    b.writer_unacked += w.unacked
    b.writer_seq = w.seq + 1


def wait_acks(w: Writer, after: float, count: int, timeout_s: float) -> bool:
    """Wait for `count` acks of writes acknowledged after `after` (time.monotonic())."""
    for _ in deadline_loop(timeout_s, 0.005):
        if sum(1 for _, t, _ in w.acks[-count - 5 :] if t > after) >= count:
            return True
    return False
