"""Phase: no acknowledged write lost, checked with linearizable lookups on every replica.

Every loaded chain and every writer batch that was acknowledged (by the
leader-kill and compaction phases' writers) is looked up on each replica
with `LookupBatch(linearizable=True)`; a short prefix is resolved block by
block, so the count is of entries, not chains.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

from bench.directory.cluster import NAMESPACE, Bench
from bench.directory.threads import WRITER_BATCH, WRITER_NODE
from bench.measure import say
from bench.shape import writer_hashes
from kvdir.local import Replica
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

CHAINS_PER_RPC = 32
WRITER_BATCHES_PER_RPC = 256
BLOCKS_PER_RPC = 256
RETRIES_MAX = 20
RETRY_S = 0.2


def lin_batch(
    stub: pb_grpc.PrefixDirectoryStub, chains: Sequence[Sequence[bytes]]
) -> pb.LookupBatchResponse:
    req = pb.LookupBatchRequest(
        lookups=[
            pb.LookupRequest(namespace=NAMESPACE, block_hashes=c, omit_records=True, max_nodes=64)
            for c in chains
        ],
        linearizable=True,
    )
    last: grpc.RpcError | None = None
    for _ in range(RETRIES_MAX):
        try:
            resp: pb.LookupBatchResponse = stub.LookupBatch(req, timeout=30.0)
            return resp
        except grpc.RpcError as e:
            last = e
            time.sleep(RETRY_S)  # a back-off between retries, not a wait for a condition
    raise RuntimeError(f"verification lookup failed: {last}")


def missing(stub: pb_grpc.PrefixDirectoryStub, chain: Sequence[bytes], node: str) -> int:
    """Blocks of `chain` that `node` does not hold, one lookup per block."""
    out = 0
    for i in range(0, len(chain), BLOCKS_PER_RPC):
        resp = lin_batch(stub, [[h] for h in chain[i : i + BLOCKS_PER_RPC]])
        for res in resp.results:
            out += not any(m.node_id == node for m in res.matches)
    return out


def _load_lost(b: Bench, stub: pb_grpc.PrefixDirectoryStub) -> tuple[int, int]:
    """(entries lost, chains short) of the initial load."""
    s = b.shape
    lost = short = 0
    for i in range(0, s.chains, CHAINS_PER_RPC):
        chains = list(range(i, min(i + CHAINS_PER_RPC, s.chains)))
        resp = lin_batch(stub, [s.chain_hashes(c) for c in chains])
        for c, res in zip(chains, resp.results, strict=True):
            got = {m.node_id: m.prefix_blocks for m in res.matches}
            for h in s.holders(c):
                if got.get(s.node_id(h), 0) != s.chain_blocks:
                    short += 1
                    lost += missing(stub, s.chain_hashes(c), s.node_id(h))
    return lost, short


def _writer_lost(stub: pb_grpc.PrefixDirectoryStub, writer: list[int]) -> int:
    lost = 0
    for i in range(0, len(writer), WRITER_BATCHES_PER_RPC):
        seqs = writer[i : i + WRITER_BATCHES_PER_RPC]
        resp = lin_batch(stub, [writer_hashes(q, WRITER_BATCH) for q in seqs])
        for q, res in zip(seqs, resp.results, strict=True):
            got = {m.node_id: m.prefix_blocks for m in res.matches}
            if got.get(WRITER_NODE, 0) != WRITER_BATCH:
                lost += missing(stub, writer_hashes(q, WRITER_BATCH), WRITER_NODE)
    return lost


def _replica(b: Bench, r: Replica, writer: list[int]) -> dict[str, Any]:
    stub = b.stubs.stub[r.grpc_address]
    lost, short = _load_lost(b, stub)
    st = b.stubs.status(r.grpc_address, 2.0)
    return {
        "load_entries_lost": lost,
        "load_chains_short": short,
        "writer_entries_lost": _writer_lost(stub, writer),
        "entries": st.entries if st else None,
    }


def run(b: Bench) -> None:
    """Linearizable lookups on every replica of every acknowledged entry."""
    s = b.shape
    b.wait_caught_up(60.0)
    writer = sorted(set(b.writer_acked))
    out = {r.replica_id: _replica(b, r, writer) for r in b.cluster.replicas}
    acknowledged = s.entries + len(writer) * WRITER_BATCH
    lost_total = max(v["load_entries_lost"] + v["writer_entries_lost"] for v in out.values())
    b.results["verification"] = {
        "method": "LookupBatch(linearizable=True, omit_records=True) on every replica of "
        "every loaded chain and every acknowledged writer batch; a short prefix is "
        "resolved block by block",
        "acknowledged_entries": acknowledged,
        "acknowledged_writer_batches": len(writer),
        "writer_batches_maybe_committed_unacked": len(b.writer_unacked),
        "expected_entries_min": acknowledged + (1 if b.filled else 0),
        "replicas": out,
        "lost_entries": lost_total,
    }
    say(
        f"verification: lost {lost_total} of {acknowledged:,} acknowledged entries "
        "(max over replicas)"
    )
