"""Phase: the fixed cost of a fetch: one 64 KiB block end to end, tcp and shm.

Next to it, timed the same way in the same rounds: an empty engine RPC (a
Lookup of no blocks) and a bare directory Lookup with records, against the
leader. 3 warm-up rounds first (peer handshake cached).
"""

from __future__ import annotations

import time

from bench.measure import ms_stats_from_s, say
from bench.transfer.config import NS_SMALL, SMALL_BLOCK_BYTES, BenchError
from bench.transfer.setup import Bench

WARMUP_ROUNDS = 3


def run(b: Bench) -> None:
    ns = NS_SMALL
    say(f"fixed overhead: one {SMALL_BLOCK_BYTES >> 10} KiB block, {b.cfg.overhead_reps} reps")
    chain, held = b.store(ns, 1, b.rng.getrandbits(63))
    dsts = {t: c.allocate(ns, 1).slots for t, (c, _) in b.readers.items()}
    assert b.directory is not None
    leader = b.cluster.wait_leader(30)
    samples: dict[str, list[float]] = {
        k: [] for k in ("tcp", "shm", "tcp_agent", "shm_agent", "engine_rpc", "directory_lookup")
    }
    reader_b = b.clients["reader-b"]
    for rep in range(b.cfg.overhead_reps + WARMUP_ROUNDS):  # warm-up rounds
        got: dict[str, float] = {}
        for transport in ("tcp", "shm"):
            client, _ = b.readers[transport]
            b.poison(ns, client, dsts[transport])
            got[transport], got[f"{transport}_agent"] = b.fetch(
                ns, transport, chain, dsts[transport], SMALL_BLOCK_BYTES
            )
            b.verify(ns, client, held, dsts[transport])
        t0 = time.perf_counter()
        reader_b.lookup(ns, [])  # an empty chain: the engine RPC alone
        got["engine_rpc"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        resp = b.directory.lookup(
            ns, chain, max_nodes=8, exclude_node="reader-b", address=leader.grpc_address
        )
        got["directory_lookup"] = time.perf_counter() - t0
        if not resp.matches:
            raise BenchError("the directory lost the small block")
        if rep >= WARMUP_ROUNDS:
            for k, v in got.items():
                samples[k].append(v)
    b.results["fixed_overhead"] = {
        "block_bytes": SMALL_BLOCK_BYTES,
        "directory_lookup_replica": f"{leader.replica_id} (leader)",
        **{k: ms_stats_from_s(v) for k, v in samples.items()},
    }
    b.a.free(ns, held)
    for t, (c, _) in b.readers.items():
        c.free(ns, dsts[t])
