"""Phase: single Lookup latency and throughput against a follower, next to the Echo baseline.

The query chains (at most `QUERY_CHAINS_MAX`, drawn at random) are checked
once each before any timing; then Lookup and Echo run in A B B A slices, one
request in flight and then `--clients` in flight, so drift hits both alike.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.directory import echo, rpc
from bench.directory.cluster import ECHO, LOOKUP, NAMESPACE, Bench
from bench.measure import ms_stats_from_ns, say
from bench.workers import channel, raw_method
from kvdir.core.client import lookup_request
from kvdir.local import Replica
from kvdir.report import fmt

QUERY_CHAINS_MAX = 1024


def _check(b: Bench, target: Replica) -> tuple[int, list[tuple[int, int]]]:
    """One lookup per query: (wrong answers, (request, response) sizes); sets the Echo twins."""
    s = b.shape
    ch = channel(target.grpc_address)
    call = raw_method(ch, LOOKUP, "LookupResponse")
    wrong = 0
    sizes: list[tuple[int, int]] = []
    cache: dict[tuple[int, int], bytes] = {}
    b.echo_reqs = []
    try:
        for c, req in zip(b.queries, b.lookup_reqs, strict=True):
            resp = call(req, timeout=10.0)
            got = sorted((m.node_id, m.prefix_blocks) for m in resp.matches)
            want = sorted((s.node_id(h), s.chain_blocks) for h in s.holders(c))
            wrong += got != want
            key = (len(req), resp.ByteSize())
            sizes.append(key)
            if key not in cache:
                cache[key] = echo.echo_like(*key)
            b.echo_reqs.append(cache[key])
    finally:
        ch.close()
    return wrong, sizes


def prepare(b: Bench, target: Replica) -> dict[str, Any]:
    """Pick query chains, check one lookup of each, size the Echo twins."""
    s = b.shape
    n = min(s.chains, QUERY_CHAINS_MAX)
    b.queries = b.rng.sample(range(s.chains), n)
    b.lookup_reqs = [
        lookup_request(NAMESPACE, s.chain_hashes(c)).SerializeToString() for c in b.queries
    ]
    b.target = target
    wrong, sizes = _check(b, target)
    return {
        "query_chains": n,
        "multi_holder_queries": sum(len(s.holders(c)) > 1 for c in b.queries),
        "wrong_answers": wrong,
        "lookup_request_bytes_mean": statistics.fmean(x for x, _ in sizes),
        "lookup_response_bytes_mean": statistics.fmean(y for _, y in sizes),
        "lookup_response_bytes_distinct": sorted({y for _, y in sizes}),
        "echo_request_bytes_mean": statistics.fmean(len(e) for e in b.echo_reqs),
        "echo_response_bytes_distinct": sorted({echo.response_bytes(e) for e in b.echo_reqs}),
    }


def ab(b: Bench, target: Replica, concurrency: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lookup and Echo in A B B A order, half of --duration per slice."""
    parts: dict[str, list[dict[str, Any]]] = {"lookup": [], "echo": []}
    half = b.cfg.duration_s / 2
    calls = {
        "lookup": rpc.Calls(LOOKUP, "LookupResponse", b.lookup_reqs),
        "echo": rpc.Calls(ECHO, "EchoResponse", b.echo_reqs),
    }
    for kind in ("lookup", "echo", "echo", "lookup"):
        parts[kind].append(rpc.measure(b, target, calls[kind], concurrency, half))
    return rpc.pool(parts["lookup"]), rpc.pool(parts["echo"])


def by_kind(b: Bench, m: dict[str, Any]) -> dict[str, dict[str, float]]:
    single: list[int] = []
    multi: list[int] = []
    for ns, i in zip(m["_lat"], m["_idx"], strict=True):
        (multi if len(b.shape.holders(b.queries[i])) > 1 else single).append(ns)
    return {"single_holder": ms_stats_from_ns(single), "multi_holder": ms_stats_from_ns(multi)}


def run(b: Bench) -> None:
    cfg = b.cfg
    target = b.follower()
    say(f"lookups against follower {target.replica_id}")
    sizing = prepare(b, target)
    if sizing["wrong_answers"]:
        raise RuntimeError(f"{sizing['wrong_answers']} lookups gave a wrong answer")
    say(f"  single Lookup vs Echo, 1 in flight ({cfg.duration_s:.0f}s each, ABBA)")
    l1, e1 = ab(b, target, 1)
    say(f"  lookup p50 {l1['p50_ms']:.3f} ms, echo p50 {e1['p50_ms']:.3f} ms")
    say(f"  single Lookup vs Echo, {cfg.clients} in flight")
    ln, en = ab(b, target, cfg.clients)
    say(f"  lookups/s {fmt(ln['per_s'])}, echo/s {fmt(en['per_s'])}")
    l1_kinds, ln_kinds = by_kind(b, l1), by_kind(b, ln)
    rpc.strip(l1, e1, ln, en)
    b.results["lookup"] = {
        "replica": target.replica_id,
        "role": "follower",
        "sizing": sizing,
        "latency": {**l1, "by_kind": l1_kinds},
        "throughput": {**ln, "by_kind": ln_kinds},
        "request_form": "pre-serialized LookupRequest bytes in the packed form "
        "(packed_hashes, as directory.client sends them; no client-side building); "
        "responses parsed into LookupResponse; records included; max_nodes default",
    }
    b.results["echo"] = echo.results(target.replica_id, l1, e1, ln, en)
