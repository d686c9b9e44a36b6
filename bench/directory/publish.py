"""Phase: publish throughput, the initial load itself (batches through the leader).

Every entry of the data shape is published once, `--publish-inflight` RPCs in
flight straight to the leader; a Publish is acknowledged after the leader
applied it. The replicas' RSS before and after gives their bytes per entry.
"""

from __future__ import annotations

import math
import time
from typing import Any

from bench.directory.cluster import (
    FILLER_NODE,
    LEASE_MS,
    NAMESPACE,
    PUBLISH,
    RUN_S_MAX,
    Bench,
    merge_errors,
)
from bench.directory.threads import WRITER_NODE, Heartbeats
from bench.host import busy_share, machine_cpu
from bench.measure import ms_stats_from_ns, say
from bench.workers import CallTask
from kvdir.core.client import DirectoryClient
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

LOAD_TIMEOUT_S_MIN = 300.0
LOAD_ENTRIES_PER_S_MIN = 2000
"""The load's timeout grows with --entries at this slowest acceptable rate."""


def register(b: Bench) -> Heartbeats:
    """Register every holder node and the writer/filler; keep their leases alive."""
    nodes = [b.shape.node_id(n) for n in range(b.shape.nodes)]
    nodes += [WRITER_NODE, FILLER_NODE]
    with DirectoryClient(b.cluster.grpc_addresses, timeout_s=10.0) as c:
        for i, n in enumerate(nodes):
            c.register_node(
                n,
                "127.0.0.1",
                b.incarnation,
                f"127.0.0.1:{9000 + i}",
                ["tcp"],
                lease_ms=LEASE_MS,
            )
    hb = Heartbeats(b.cluster.grpc_addresses, nodes, b.incarnation, max_s=RUN_S_MAX)
    hb.start()
    return hb


def publish_requests(b: Bench) -> list[bytes]:
    s = b.shape
    return [
        pb.PublishRequest(
            node_id=s.node_id(x.node),
            incarnation=b.incarnation,
            namespace=NAMESPACE,
            tier=pb.TIER_GPU,
            block_hashes=x.hashes,
            addresses=x.addresses,
            lengths=x.lengths,
            rkeys=x.rkeys,
            generations=x.generations,
        ).SerializeToString()
        for x in s.batches(b.cfg.publish_batch)
    ]


def data_shape(b: Bench) -> dict[str, Any]:
    return {
        **b.shape.describe(),
        "namespace": f"{NAMESPACE.model} {NAMESPACE.dtype} {NAMESPACE.block_tokens} tokens "
        f"{NAMESPACE.layout}",
        "publish_batch_entries": b.cfg.publish_batch,
        "layout": "chain c is published by node c % 16; every 5th chain also by a second "
        "node, so those blocks have two holders and take the multi-holder lookup path",
    }


def _tasks(b: Bench, address: str, reqs: list[bytes], procs: int, threads: int) -> list[CallTask]:
    start_at = time.time() + 1.0
    return [
        CallTask(
            address,
            PUBLISH,
            "PublishResponse",
            reqs[w::procs],
            start_at,
            0.0,
            len(reqs),
            threads=threads,
            timeout_s=30.0,
            sum_field="applied",
        )
        for w in range(procs)
    ]


def run(b: Bench) -> None:
    cfg = b.cfg
    rss_empty = b.rss()
    b.results["data_shape"] = data_shape(b)
    reqs = publish_requests(b)
    leader = b.leader()
    procs = min(b.pool.size, cfg.publish_inflight)
    threads = math.ceil(cfg.publish_inflight / procs)
    say(
        f"loading {b.shape.entries:,} entries as {len(reqs)} Publish RPCs of "
        f"<= {cfg.publish_batch} through leader {leader.replica_id} "
        f"({procs} processes x {threads} threads in flight)"
    )
    tasks = _tasks(b, leader.grpc_address, reqs, procs, threads)
    cpu0, pid_cpu0 = machine_cpu(), b.replica_cpu_s()
    timeout_s = max(LOAD_TIMEOUT_S_MIN, b.shape.entries / LOAD_ENTRIES_PER_S_MIN)
    res = b.pool.run(tasks, timeout_s=timeout_s)
    cpu1, pid_cpu1 = machine_cpu(), b.replica_cpu_s()
    window = max(r.finished for r in res) - min(r.started for r in res)
    applied = sum(r.summed for r in res)
    failed = sum(r.failed for r in res)
    caught_s = b.wait_caught_up(120.0)
    st = b.statuses()
    b.results["publish"] = {
        "what": "the initial load: every entry published once, batches straight to the "
        "leader, committed (acknowledged after the leader applied it)",
        "entries": b.shape.entries,
        "entries_applied": applied,
        "rpcs": len(reqs),
        "rpcs_failed": failed,
        "batch_entries": cfg.publish_batch,
        "inflight": procs * threads,
        "wall_s": window,
        "entries_per_s": applied / window if window > 0 else math.nan,
        "rpc_latency": ms_stats_from_ns([x for r in res for x in r.latencies_ns]),
        "errors": merge_errors(res),
        "machine_cpu_busy": busy_share(cpu0, cpu1),
        "replica_cpu_s": {k: pid_cpu1[k] - pid_cpu0[k] for k in pid_cpu0},
        "followers_caught_up_after_s": caught_s,
        "replica_entries": {k: s.entries for k, s in st.items()},
        "leader": leader.replica_id,
    }
    say(
        f"load: {applied:,} entries in {window:.2f}s = "
        f"{fmt(applied / window)} entries/s; failed RPCs {failed}"
    )
    for k, s in st.items():
        if s.entries != b.shape.entries:
            raise RuntimeError(f"{k} holds {s.entries} entries, expected {b.shape.entries}")
    _replica_memory(b, rss_empty)


def _replica_memory(b: Bench, rss_empty: dict[str, int]) -> None:
    rss_loaded = b.rss()
    b.results["memory"] = {
        "replicas": {
            "rss_bytes_empty": rss_empty,
            "rss_bytes_loaded": rss_loaded,
            "entries": b.shape.entries,
            "bytes_per_entry": {
                k: (rss_loaded[k] - rss_empty.get(k, 0)) / b.shape.entries for k in rss_loaded
            },
        }
    }
