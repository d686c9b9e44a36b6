"""A mirror's in-process lookups at N entries, on one core, in a fresh process.

Run as ``python -m bench.mirror_table --entries N``. Builds a `Mirror`'s table
the way its Watch stream does (encoded Publish commands decoded and applied,
the benchmark's data shape: 500-block chains, some held by several nodes),
then answers the lookup phase's kind of query (a whole stored chain) with one
thread, in four forms, each next to the others (per form: latencies, calls per
wall-clock second, and calls per second of the thread's own CPU time, which is
what one core gives when the machine is shared):

- ``table``: `Table.lookup` alone (matches, no answer built);
- ``prefix_lengths``: the routing form (`Mirror.prefix_lengths`: node id and
  prefix length per holder, nothing else);
- ``holders``: node id, prefix, host, transports per holder;
- ``message``: the Lookup RPC's own response message, records included.

It also times the mirror's apply path (commands per second a mirror keeps up
with). Prints one JSON object. A separate process so nothing else this
benchmark allocated or runs competes with it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.memory import NAMESPACE, rss_bytes
from bench.shape import TIER, DataShape
from kvdir.core.client import lookup_request
from kvdir.core.mirror import Mirror
from kvdir.directory import codec
from kvdir.directory.commands import Publish, RegisterNode
from kvdir.directory.lookup import Chain
from kvdir.directory.validate import namespace_key

QUERIES = 2000
MAX_NODES = 8
BATCH_ENTRIES = 4096
DURATION_S = 5.0


def _stats(lat_ns: list[int], wall_s: float, cpu_s: float) -> dict[str, float]:
    lat = sorted(lat_ns)
    n = len(lat)
    return {
        "n": n,
        "p50_ms": lat[n // 2] / 1e6,
        "p90_ms": lat[int(n * 0.9)] / 1e6,
        "p99_ms": lat[int(n * 0.99)] / 1e6,
        "max_ms": lat[-1] / 1e6,
        "mean_ms": sum(lat) / n / 1e6,
        "chains_per_s": n / wall_s,
        "cpu_s": cpu_s,
        "chains_per_cpu_s": n / cpu_s,
    }


def build(shape: DataShape, batch_entries: int = BATCH_ENTRIES) -> tuple[Mirror, dict[str, Any]]:
    """The mirror's table through its own apply path (decoded commands, as streamed).

    `batch_entries` below the chain length splits chains across Publish
    commands, as `kvdir bench directory` (1,024) and real engines (one command
    per request) do, so a stored chain is several runs of slots."""
    m = Mirror(max_staleness_s=float("inf"))
    t = m.table
    ns = namespace_key(NAMESPACE)
    for n in range(shape.nodes):
        t.apply(RegisterNode(shape.node_id(n), "127.0.0.1", "", ("tcp",), 1, 600_000, 0))
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for b in shape.batches(batch_entries):
        cmd = Publish(
            shape.node_id(b.node), 1, ns, TIER, b.hashes, b.addresses, b.lengths, b.rkeys,
            b.generations,
        )  # fmt: skip
        t.apply(codec.decode(codec.encode(cmd)))
    build_s = time.perf_counter() - t0
    m.ready = True
    m.commit_index = m.applied_index = 1
    gc.collect()
    return m, {
        "entries": t.entries,
        "build_s": build_s,
        "apply_entries_per_s": t.entries / build_s,
        "rss_growth_bytes": rss_bytes() - rss0,
        "batch_entries": batch_entries,
    }


def timed(call: Callable[[int], object], n: int, duration_s: float) -> dict[str, float]:
    lat: list[int] = []
    i = 0
    c0 = time.thread_time()
    t0 = time.perf_counter()
    end = t0 + duration_s
    while time.perf_counter() < end:
        a = time.perf_counter_ns()
        call(i % n)
        lat.append(time.perf_counter_ns() - a)
        i += 1
    return _stats(lat, time.perf_counter() - t0, time.thread_time() - c0)


def measure(
    entries: int, duration_s: float, seed: int, batch_entries: int = BATCH_ENTRIES
) -> dict[str, Any]:
    shape = DataShape.for_entries(entries)
    m, built = build(shape, batch_entries)
    rng = random.Random(seed)
    queries = rng.sample(range(shape.chains), min(QUERIES, shape.chains))
    hashes = [shape.chain_hashes(c) for c in queries]
    reqs = [lookup_request(NAMESPACE, h, MAX_NODES) for h in hashes]
    chains = [Chain.of(h) for h in hashes]
    key = namespace_key(NAMESPACE)
    wrong = sum(
        sorted(m.prefix_lengths(key, chains[i], MAX_NODES))
        != sorted((shape.node_id(h), shape.chain_blocks) for h in shape.holders(c))
        for i, c in enumerate(queries)
    )
    forms: dict[str, Callable[[int], object]] = {
        "table": lambda i: m.table.lookup(key, chains[i], MAX_NODES),
        "prefix_lengths": lambda i: m.prefix_lengths(key, chains[i], MAX_NODES),
        "holders": lambda i: m.holders(key, chains[i], MAX_NODES),
        "message": lambda i: m.lookup_message(reqs[i]),
    }
    out: dict[str, Any] = {
        **built,
        "data_shape": shape.describe(),
        "chain_blocks": shape.chain_blocks,
        "queries": len(queries),
        "multi_holder_queries": sum(len(shape.holders(c)) > 1 for c in queries),
        "wrong_answers": wrong,
        "python": sys.version.split()[0],
    }
    for name, call in forms.items():
        gc.collect()
        out[name] = timed(call, len(queries), duration_s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mirror_table", description=__doc__)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--duration", type=float, default=DURATION_S, help="seconds per form")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--batch-entries", type=int, default=BATCH_ENTRIES, help="entries per Publish command"
    )
    args = p.parse_args(argv)
    print(json.dumps(measure(args.entries, args.duration, args.seed, args.batch_entries)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
