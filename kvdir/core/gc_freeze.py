"""Start-up objects out of the cyclic garbage collector's walks (`gc.freeze`).

A long-running kvdir process (a directory replica, an agent, a gateway
worker) holds some 40-100k GC-tracked objects from its start-up: modules'
functions, classes and dicts, gRPC, protobuf and aiohttp internals. None of
them ever becomes garbage, yet every full collection walks them all while
holding the GIL. On the 2-core bench host a full collection of a replica took
16-76 ms (47k objects), and under 100k entries/s of publishes each replica
ran one every 10-20 s: its Raft thread, Watch streams and RPCs stopped for
that long, and a mirror behind it lagged by as much. `kvdir bench directory`'s
mirror lag p99 was 144 and 105 ms in two of three runs without this and 16.5
and 18.8 ms in both runs with it (bench/results/mirror-gc-2026-12-03.md).

`freeze_startup` collects once, then moves every surviving object to the
permanent generation, which later collections skip; objects created after it
are collected as before. Frozen objects are still freed by reference counting
when dropped; only a reference cycle among them would never be reclaimed,
which is why it runs once per process, after start-up and before load.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("kvdir.gc")


def freeze_startup(component: str) -> int:
    """Collect, then freeze what survived; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "froze %d start-up objects out of garbage collection",
        frozen,
        extra={"component": component, "frozen_objects": frozen},
    )
    return frozen
