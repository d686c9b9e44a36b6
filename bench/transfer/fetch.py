"""Phase: fetch of `--sizes-mb` MiB from holder A into B (tcp) and C (shm), next to raw copies.

Per case (size x block shape): A stores the blocks; then `--reps` rounds after
one warm-up, each of a raw socket copy (default and fixed buffers), a tcp
fetch, a memcpy and a shm fetch, interleaved so drift hits all alike. Every
fetch is checked byte for byte; its destination is poisoned before it,
outside the timed region.
"""

from __future__ import annotations

from typing import Any

from bench.measure import ms_stats_from_s, say
from bench.transfer import blocks
from bench.transfer.config import MIB, NS_BY_TOKENS, BenchError
from bench.transfer.raw import RawSocket, memcpy
from bench.transfer.setup import Bench, Case
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

KINDS = (
    "tcp",
    "shm",
    "tcp_agent",
    "shm_agent",
    "raw_socket",
    "raw_socket_product_buffers",
    "memcpy",
)
"""Every timed path of a case, in the row's key order."""
TILE_BYTES = 4 * MIB


def _buffers(b: Bench) -> tuple[memoryview, memoryview]:
    """Two preallocated, pre-touched buffers of the largest case (the baselines' ends)."""
    src_all, dst_all = memoryview(bytearray(b.max_bytes)), memoryview(bytearray(b.max_bytes))
    for pos in range(0, b.max_bytes, TILE_BYTES):
        k = min(TILE_BYTES, b.max_bytes - pos)
        src_all[pos : pos + k] = b.seed_tile[:k]
    dst_all[:] = src_all  # touch every page of both before any timing
    return src_all, dst_all


def _round(
    b: Bench,
    raw: RawSocket,
    ns: pb.Namespace,
    case: Case,
    chain: list[bytes],
    held: list[int],
    dsts: dict[str, list[int]],
    src: memoryview,
    dst: memoryview,
) -> dict[str, float]:
    """One rep: every path once, in the interleaved order; seconds per path."""
    got: dict[str, float] = {}
    got["raw_socket"] = raw.copy(dst, "default")
    got["raw_socket_product_buffers"] = raw.copy(dst, "tuned")
    for transport in ("tcp", "shm"):
        client, _ = b.readers[transport]
        b.poison(ns, client, dsts[transport])
        e2e, agent_s = b.fetch(ns, transport, chain, dsts[transport], case.nbytes)
        b.verify(ns, client, held, dsts[transport])
        got[transport], got[f"{transport}_agent"] = e2e, agent_s
        if transport == "tcp":
            got["memcpy"] = memcpy(dst, src)
    return got


def _row(
    case: Case,
    held: list[int],
    dsts: dict[str, list[int]],
    cold: dict[str, float],
    samples: dict[str, list[float]],
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "size_mib_asked": case.size_mib,
        "block_tokens": case.block_tokens,
        "block_bytes": case.block_bytes,
        "blocks": case.blocks,
        "bytes": case.nbytes,
        "segments": {t: blocks.segments(held, d) for t, d in dsts.items()},
        "verified": True,
        "cold_first_ms": cold,
    }
    for name, secs in samples.items():
        st: dict[str, Any] = ms_stats_from_s(secs)
        st["gbps_median"] = case.nbytes / (st["median_ms"] / 1e3) / 1e9
        st["gbps_best"] = case.nbytes / (st["min_ms"] / 1e3) / 1e9
        st["samples_ms"] = [x * 1e3 for x in secs]
        row[name] = st
    row["tcp_vs_raw_socket"] = row["raw_socket"]["median_ms"] / row["tcp"]["median_ms"]
    row["tcp_vs_raw_socket_best"] = row["raw_socket"]["min_ms"] / row["tcp"]["min_ms"]
    row["shm_vs_memcpy"] = row["memcpy"]["median_ms"] / row["shm"]["median_ms"]
    row["shm_vs_memcpy_best"] = row["memcpy"]["min_ms"] / row["shm"]["min_ms"]
    return row


def _case(b: Bench, raw: RawSocket, case: Case, src_all: memoryview, dst_all: memoryview) -> Any:
    ns = NS_BY_TOKENS[case.block_tokens]
    say(f"fetch case: {case.label} ({case.blocks} blocks)")
    chain, held = b.store(ns, case.blocks, b.rng.getrandbits(63))
    dsts = {t: c.allocate(ns, case.blocks).slots for t, (c, _) in b.readers.items()}
    src, dst = src_all[: case.nbytes], dst_all[: case.nbytes]
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    cold: dict[str, float] = {}
    for rep in range(b.cfg.reps + 1):  # rep 0 warms up (handshake, page faults)
        got = _round(b, raw, ns, case, chain, held, dsts, src, dst)
        if rep == 0:
            cold = {name: sec * 1e3 for name, sec in got.items()}
            continue
        for name, sec in got.items():
            samples[name].append(sec)
    if not blocks.same_bytes(src, dst):
        raise BenchError("memcpy baseline copied wrong bytes")
    row = _row(case, held, dsts, cold, samples)
    say(
        f"  tcp {fmt(row['tcp']['median_ms'])} ms vs raw socket "
        f"{fmt(row['raw_socket']['median_ms'])} ms ({fmt(row['tcp_vs_raw_socket'])}x); "
        f"shm {fmt(row['shm']['median_ms'])} ms vs memcpy "
        f"{fmt(row['memcpy']['median_ms'])} ms ({fmt(row['shm_vs_memcpy'])}x)"
    )
    b.a.free(ns, held)
    for t, (c, _) in b.readers.items():
        c.free(ns, dsts[t])
    return row


def run(b: Bench) -> None:
    b.raw = RawSocket(b.max_bytes)
    try:
        src_all, dst_all = _buffers(b)
        b.results["fetch"] = [_case(b, b.raw, case, src_all, dst_all) for case in b.cases]
        del src_all, dst_all
    finally:
        b.raw.close()
        b.raw = None
