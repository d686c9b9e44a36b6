"""Phase: LookupBatch chains/s and per-RPC latency, with and without records.

The same query chains as the lookups phase, `--batch-chains` per RPC in a
shuffled order, against the same follower: one RPC in flight, then
`--clients` in flight, then `--clients` in flight with `omit_records`.
"""

from __future__ import annotations

from bench.directory import rpc
from bench.directory.cluster import LOOKUP_BATCH, NAMESPACE, Bench
from bench.measure import say
from kvdir.core.client import lookup_request
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

BATCHES_MIN = 8


def _batches(b: Bench, k: int) -> list[list[int]]:
    order = list(range(len(b.queries)))
    b.rng.shuffle(order)
    n_batches = max(BATCHES_MIN, len(order) // k)
    return [
        [b.queries[order[(i * k + j) % len(order)]] for j in range(k)] for i in range(n_batches)
    ]


def _requests(b: Bench, batches: list[list[int]], omit: bool) -> list[bytes]:
    return [
        pb.LookupBatchRequest(
            lookups=[
                lookup_request(NAMESPACE, b.shape.chain_hashes(c), omit_records=omit)
                for c in chains
            ]
        ).SerializeToString()
        for chains in batches
    ]


def run(b: Bench) -> None:
    cfg = b.cfg
    target = b.target or b.follower()
    k = cfg.batch_chains
    batches = _batches(b, k)
    with_records, omitted = _requests(b, batches, False), _requests(b, batches, True)
    say(f"  LookupBatch of {k} chains")
    records = rpc.Calls(LOOKUP_BATCH, "LookupBatchResponse", with_records)
    omit = rpc.Calls(LOOKUP_BATCH, "LookupBatchResponse", omitted)
    b1 = rpc.measure(b, target, records, 1, cfg.duration_s)
    bn = rpc.measure(b, target, records, cfg.clients, cfg.duration_s)
    bo = rpc.measure(b, target, omit, cfg.clients, cfg.duration_s)
    for m in (b1, bn, bo):
        m["chains_per_s"] = m["per_s"] * k
    rpc.strip(b1, bn, bo)
    say(
        f"  LookupBatch chains/s {fmt(bn['chains_per_s'])} (records), "
        f"{fmt(bo['chains_per_s'])} (omit_records)"
    )
    b.results["lookup_batch"] = {
        "replica": target.replica_id,
        "chains_per_rpc": k,
        "latency": b1,
        "throughput": bn,
        "throughput_omit_records": bo,
        "chains_per_s": bn["chains_per_s"],
    }
