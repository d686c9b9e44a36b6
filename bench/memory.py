"""Bytes per (block, holder) entry of the directory table, measured in a fresh process.

Run as ``python -m bench.memory --entries N``: builds a
`directory.table.Table` (the structure each replica holds) through
`Table.apply(Publish(...))` with the benchmark's data shape, and prints one
JSON object: RSS growth from /proc/self/statm divided by entries, plus a
breakdown of what the table's containers account for. The Publish commands
are built batch by batch and dropped after applying (as a replica drops the
decoded Raft entry), with fresh hash objects per batch, as decoding makes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from bench.shape import TIER, DataShape
from kvdir.directory.commands import Publish, Published, RegisterNode
from kvdir.directory.table import Table
from kvdir.directory.validate import namespace_key
from kvdir.v1 import directory_pb2 as pb

_PAGE = os.sysconf("SC_PAGE_SIZE")
NAMESPACE = pb.Namespace(
    model="meta-llama/Llama-3.1-8B", dtype="bf16", block_tokens=16, layout="vllm-paged"
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _breakdown(t: Table) -> dict[str, int]:
    c = t.col
    arrays = sum(a.buffer_info()[1] * a.itemsize for a in c.arrays())
    keys_list = sys.getsizeof(c.key)
    seen: set[int] = set()
    key_objs = 0
    for k in c.key:
        if k is not None and id(k) not in seen:
            seen.add(id(k))
            # pymalloc hands out 16-byte-aligned blocks
            key_objs += (sys.getsizeof(k) + 15) // 16 * 16
    for b in t.blocks:
        for k in b:
            if id(k) not in seen:
                seen.add(id(k))
                key_objs += (sys.getsizeof(k) + 15) // 16 * 16
    dicts = sum(sys.getsizeof(b) for b in t.blocks)
    return {
        "slot_arrays": arrays,
        "key_list": keys_list,
        "hash_objects": key_objs,
        "block_dicts": dicts,
        "total": arrays + keys_list + key_objs + dicts,
    }


def measure(entries: int, batch_entries: int = 4096, breakdown: bool = True) -> dict[str, Any]:
    shape = DataShape.for_entries(entries)
    ns = namespace_key(NAMESPACE)
    gc.collect()
    table = Table()
    for n in range(shape.nodes):
        table.apply(RegisterNode(shape.node_id(n), "127.0.0.1", "", ("tcp",), 1, 600_000, 0))
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    applied = 0
    deadline = time.monotonic() + 3600
    for b in shape.batches(batch_entries):
        res = table.apply(
            Publish(
                shape.node_id(b.node),
                1,
                ns,
                TIER,
                b.hashes,
                b.addresses,
                b.lengths,
                b.rkeys,
                b.generations,
            )
        )
        assert isinstance(res, Published), res
        applied += res.applied
        if time.monotonic() > deadline:
            raise SystemExit("memory measurement ran over an hour")
    build_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    if table.entries != shape.entries or applied != shape.entries:
        raise SystemExit(f"table holds {table.entries} entries, expected {shape.entries}")
    out: dict[str, Any] = {
        "entries": table.entries,
        "blocks": table.block_count,
        "data_shape": shape.describe(),
        "rss_before_bytes": rss0,
        "rss_after_bytes": rss1,
        "rss_growth_bytes": rss1 - rss0,
        "bytes_per_entry": (rss1 - rss0) / table.entries,
        "build_s": build_s,
        "apply_entries_per_s": table.entries / build_s,
        "python": sys.version.split()[0],
    }
    if breakdown:
        try:
            parts = _breakdown(table)
        except (AttributeError, TypeError):  # the table's layout changed: skip the breakdown
            return out
        out["accounted_bytes"] = parts
        out["accounted_bytes_per_entry"] = {k: v / table.entries for k, v in parts.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    p.add_argument("--entries", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--no-breakdown", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.entries, args.batch, not args.no_breakdown)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
