"""How long one publish can stall a replica's apply as a namespace grows.

Run as ``python -m bench.apply_stalls --entries N``. Applies fresh publishes
of `--batch` new 8-byte blocks to a `Table` until it holds N entries and
records each apply's time; beside it, in the same process and with the same
keys, the baseline: the same inserts into one plain dict (what the table's
block map was before `BlockIndex`), whose grows rehash every key at once.
Prints one JSON object: per variant, mean and worst times and every apply
over `--stall-ms`, with the entry count where it happened.

A replica applies on its Raft thread: an apply longer than the election
timeout (150 ms by default) stops heartbeats long enough for followers to
campaign, and delays every mirror by as much.
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

from kvdir.directory.commands import Publish, RegisterNode, Tier
from kvdir.directory.table import Table
from kvdir.directory.validate import namespace_key
from kvdir.v1 import directory_pb2 as pb

NODE = "node-0"


def _batches(entries: int, batch: int, seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    return [[rng.randbytes(8) for _ in range(batch)] for _ in range(entries // batch)]


def _timed(apply: Callable[[list[bytes], int], object], batches: list[list[bytes]],
           stall_ms: float) -> dict[str, Any]:  # fmt: skip
    times: list[float] = []
    stalls: list[tuple[int, float]] = []
    done = 0
    gc.collect()
    for hs in batches:
        t0 = time.perf_counter()
        apply(hs, done)
        dt = (time.perf_counter() - t0) * 1000
        done += len(hs)
        times.append(dt)
        if dt > stall_ms:
            stalls.append((done, round(dt, 1)))
    return {
        "applies": len(times),
        "mean_ms": sum(times) / len(times),
        "p99_ms": sorted(times)[int(len(times) * 0.99)],
        "max_ms": max(times),
        "stalls": stalls,
    }


def measure(entries: int, batch: int, stall_ms: float, seed: int) -> dict[str, Any]:
    batches = _batches(entries, batch, seed)
    gc.collect()
    gc.freeze()  # the prepared keys are the bench's, not a replica's: out of the GC's walks
    ns = namespace_key(pb.Namespace(model="bench", dtype="bf16", block_tokens=16))
    t = Table()
    t.apply(RegisterNode(NODE, "127.0.0.1", "", ("tcp",), 1, 600_000, 0))
    n = batch

    def table_apply(hs: list[bytes], _: int) -> object:
        return t.apply(
            Publish(NODE, 1, ns, int(Tier.GPU), hs, [0] * n, [4096] * n, [7] * n, [1] * n)
        )

    one: dict[bytes, int] = {}

    def dict_insert(hs: list[bytes], start: int) -> object:
        if one.keys().isdisjoint(hs):  # the table's freshness check, then its insert
            one.update(zip(hs, range(start, start + len(hs)), strict=True))
        return None

    baseline = _timed(dict_insert, batches, stall_ms)
    one.clear()  # its memory back before the table's run
    table = _timed(table_apply, batches, stall_ms)
    return {
        "entries": entries,
        "batch_entries": batch,
        "stall_ms": stall_ms,
        "one_dict_insert": baseline,
        "table_apply": table,
        "table_entries": t.entries,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.apply_stalls", description=__doc__)
    p.add_argument("--entries", type=int, default=6_000_000)
    p.add_argument("--batch", type=int, default=1000, help="new blocks per publish")
    p.add_argument("--stall-ms", type=float, default=20.0, help="report applies over this")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if a.entries < a.batch or a.batch < 1:
        p.error("--entries must be at least --batch, and --batch at least 1")
    print(json.dumps(measure(a.entries, a.batch, a.stall_ms, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
