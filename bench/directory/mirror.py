"""Phase: an in-process mirror of the loaded directory: start, lookups, lag under publishes.

A `Mirror` fed by a Watch stream from the follower the lookup phase measured
(so its lookups sit next to that phase's Lookup and Echo in the same run):

1. start: the snapshot of the whole table over Watch until the mirror is fresh;
2. lookups: the lookup phase's query chains answered in process, records
   included (the RPC's own message), one thread (one core), and the routing
   form (`holders`: prefix lengths only, no message);
3. lag: publishes of new blocks at `LAG_ENTRIES_PER_S` through the leader;
   per acknowledged publish, from its acknowledgement until the mirror's
   applied index reached its index (negative: the mirror had it first).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from bench.directory.cluster import FILLER_NODE, NAMESPACE, Bench
from bench.measure import ms_stats_from_ns, say
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.wire import namespace_key
from kvdir.directory.lookup import Chain
from kvdir.v1 import directory_pb2 as pb

START_TIMEOUT_S = 600.0
LAG_ENTRIES_PER_S = 100_000
LAG_BATCH_ENTRIES = 1000
LAG_SENDERS = 4
LAG_DURATION_S = 8.0
POLL_S = 0.0005
"""How often the lag phase samples the mirror's applied index."""


def start(b: Bench, address: str) -> tuple[Mirror, MirrorSync, float]:
    m = Mirror(max_staleness_s=5.0)
    t0 = time.perf_counter()
    sync = MirrorSync(m, [address]).start()
    leader = b.leader()
    target = b.stubs.status(leader.grpc_address, 5.0)
    need = target.commit_index if target is not None else 1
    deadline = t0 + START_TIMEOUT_S
    while not (m.fresh() and m.applied_index >= need):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the mirror did not start in {START_TIMEOUT_S:.0f}s: {m.error}")
        time.sleep(0.05)
    return m, sync, time.perf_counter() - t0


def lookups(b: Bench, m: Mirror) -> dict[str, Any]:
    reqs = [pb.LookupRequest.FromString(r) for r in b.lookup_reqs]
    s = b.shape
    wrong = 0
    for c, req in zip(b.queries, reqs, strict=True):
        got = sorted((x.node_id, x.prefix_blocks) for x in m.lookup_message(req).matches)
        wrong += got != sorted((s.node_id(h), s.chain_blocks) for h in s.holders(c))
    out: dict[str, Any] = {"wrong_answers": wrong, "chain_blocks": s.chain_blocks}
    key = namespace_key(NAMESPACE)
    chains = [Chain(r.packed_hashes, r.hash_width) for r in reqs]
    for name, call in (
        ("message", lambda i: m.lookup_message(reqs[i])),
        ("holders", lambda i: m.holders(key, chains[i], 8)),
    ):
        lat: list[int] = []
        t_end = time.perf_counter() + b.cfg.duration_s / 2
        t0 = time.perf_counter()
        i = 0
        while time.perf_counter() < t_end:
            a = time.perf_counter_ns()
            call(i % len(reqs))
            lat.append(time.perf_counter_ns() - a)
            i += 1
        wall = time.perf_counter() - t0
        out[name] = {**ms_stats_from_ns(lat), "chains_per_s": i / wall, "n": i}
    return out


def lag(b: Bench, m: Mirror) -> dict[str, Any]:
    """Publishes at LAG_ENTRIES_PER_S; per ack, how long until the mirror had it."""
    leader = b.leader()
    stub = b.stubs.stub[leader.grpc_address]
    acks: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []
    stop = threading.Event()
    interval = LAG_BATCH_ENTRIES * LAG_SENDERS / LAG_ENTRIES_PER_S
    errors = [0]

    def send(k: int) -> None:
        rng = random.Random(b.cfg.seed * 1000 + k)
        t_next = time.perf_counter() + k * interval / LAG_SENDERS
        end = time.perf_counter() + LAG_DURATION_S
        while time.perf_counter() < end:
            stop.wait(max(0.0, t_next - time.perf_counter()))
            t_next += interval
            n = LAG_BATCH_ENTRIES
            req = pb.PublishRequest(
                node_id=FILLER_NODE,
                incarnation=b.incarnation,
                namespace=NAMESPACE,
                tier=pb.TIER_GPU,
                block_hashes=[rng.randbytes(16) for _ in range(n)],
                addresses=[0x10_0000 + 4096 * j for j in range(n)],
                lengths=[4096] * n,
                rkeys=[7] * n,
                generations=[1] * n,
            )
            try:
                resp = stub.Publish(req, timeout=10)
            except Exception:
                errors[0] += 1
                continue
            acks.append((resp.applied_index, time.perf_counter_ns()))

    def watch() -> None:
        last = -1
        while not stop.is_set():
            at = m.applied_index
            if at != last:
                seen.append((at, time.perf_counter_ns()))
                last = at
            time.sleep(POLL_S)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    senders = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(LAG_SENDERS)]
    t0 = time.perf_counter()
    for t in senders:
        t.start()
    for t in senders:
        t.join(LAG_DURATION_S + 30)
    wall = time.perf_counter() - t0
    final = max((i for i, _ in acks), default=0)
    for _ in range(2000):
        if m.applied_index >= final:
            break
        time.sleep(0.01)
    stop.set()
    w.join(5)
    lags = [_first_seen(seen, idx) - t for idx, t in acks]
    return {
        "target_entries_per_s": LAG_ENTRIES_PER_S,
        "achieved_entries_per_s": len(acks) * LAG_BATCH_ENTRIES / wall,
        "publishes": len(acks),
        "publish_errors": errors[0],
        "batch_entries": LAG_BATCH_ENTRIES,
        "lag_ms": ms_stats_from_ns(lags),
        "lag_ms_max": max(lags) / 1e6 if lags else 0.0,
    }


def _first_seen(seen: list[tuple[int, int]], index: int) -> int:
    for at, t in seen:
        if at >= index:
            return t
    return seen[-1][1] if seen else 0


def run(b: Bench) -> None:
    target = b.target or b.follower()
    say(f"mirror of follower {target.replica_id}")
    m, sync, start_s = start(b, target.grpc_address)
    say(f"  started in {start_s:.1f}s at index {m.applied_index} ({m.table.entries} entries)")
    try:
        lk = lookups(b, m)
        say(
            f"  mirror lookup p50 {lk['message']['p50_ms']:.4f} ms, "
            f"{lk['message']['chains_per_s']:.0f} chains/s (routing form "
            f"{lk['holders']['chains_per_s']:.0f}/s)"
        )
        lg = lag(b, m)
        say(
            f"  lag p99 {lg['lag_ms']['p99_ms']:.1f} ms at "
            f"{lg['achieved_entries_per_s']:.0f} entries/s"
        )
    finally:
        sync.stop()
    b.results["mirror"] = {
        "replica": target.replica_id,
        "start_s": start_s,
        "entries": m.table.entries,
        "lookups": lk,
        "lag": lg,
        "snapshots": m.snapshots,
    }
