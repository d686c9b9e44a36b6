"""Phase: `EngineClient.stored()` on the caller's thread, batches of 1 and 16 blocks.

Back to back (the target) and paced (`STORED_PACE_S` apart, so each call
starts cold), next to an empty call of the same signature timed the same
way. `time.perf_counter_ns` around each call.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.measure import say, us_stats_from_ns
from bench.transfer.config import NS_SMALL, STORED_PACE_S
from bench.transfer.setup import Bench
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb


def run(b: Bench) -> None:
    """stored() on the caller's thread: back to back (the target), and paced."""
    ns = NS_SMALL
    calls = b.cfg.stored_calls
    say(
        f"stored() enqueue latency: {calls} calls per batch size, back to back and "
        f"paced ({STORED_PACE_S * 1e6:g} us apart)"
    )
    alloc = b.a.allocate(ns, 16)
    hashes = [os.urandom(8) for _ in range(16)]
    b.a.stored(ns, hashes, alloc.slots)
    b.a.flush()

    def empty(ns: pb.Namespace, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        return None

    out: dict[str, Any] = {"pace_us": STORED_PACE_S * 1e6}
    for mode, pace in (("back_to_back", 0.0), ("paced", STORED_PACE_S)):
        for name, fn in (("empty_call", empty), ("stored", b.a.stored)):
            for batch in (1, 16):
                hs, sl = hashes[:batch], alloc.slots[:batch]
                dropped_before = b.a.dropped
                samples = timed_calls(fn, ns, hs, sl, calls, pace)
                key = f"{name}_batch_{batch}" + ("_paced" if mode == "paced" else "")
                out[key] = us_stats_from_ns(samples)
                out[key]["dropped_notifications"] = float(b.a.dropped - dropped_before)
                b.a.flush()
    for batch in (1, 16):
        s = out[f"stored_batch_{batch}"]
        say(
            f"  batch {batch}: p50 {fmt(s['p50_us'])} us, p99 {fmt(s['p99_us'])} us, "
            f"max {fmt(s['max_us'])} us"
        )
    b.results["stored_enqueue"] = out
    b.a.free(ns, alloc.slots)


def timed_calls(
    fn: Callable[[pb.Namespace, Sequence[bytes], Sequence[int]], None],
    ns: pb.Namespace,
    hashes: Sequence[bytes],
    slots: Sequence[int],
    calls: int,
    pace_s: float,
) -> list[int]:
    """`calls` timed calls of `fn`; `pace_s` > 0 sleeps that long between calls."""
    clock = time.perf_counter_ns
    out = [0] * calls
    gc.collect()
    for i in range(calls):
        t0 = clock()
        fn(ns, hashes, slots)
        out[i] = clock() - t0
        if pace_s:
            time.sleep(pace_s)
    return out


# ------------------------------------------------------------------ report
