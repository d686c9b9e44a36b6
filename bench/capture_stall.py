"""How long a compaction stops a replica's Raft thread, before and after the copy-on-write capture.

Run as ``python -m bench.capture_stall --entries 1000000 3000000``. In one
process, like a replica: a table of N entries (fresh publishes of 1,000 new
8-byte blocks, 16 nodes), a "Raft thread" that wakes every `--tick-ms` and
applies a 16-entry publish every `--publish-every` ticks (the publish load
on), and a compaction started from that thread, written to a temporary file
by a background thread as `_replica.Replica._serialize` does:

- ``before``: the capture of commit 479baed, on the Raft thread: a copy of
  every slot column, of the key list and of every namespace's chain heads;
- ``after``: `snapshot.freeze` on the Raft thread, the copy
  (`Frozen.image`) on the writer thread, then `snapshot.drop`.

Reported per size and mode: the time the capture held the Raft thread, and
the longest gap between two ticks from the compaction's start until its file
was written (the GIL is shared, so the writer's work shows here too), with
the number of gaps over `--stall-ms`. Prints one JSON object.

A gap longer than the election timeout (150-300 ms by default) is an election:
followers hear no heartbeat for that long.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from array import array
from typing import Any

from kvdir.directory import snapshot
from kvdir.directory.commands import Publish, RegisterNode, Tier
from kvdir.directory.table import Table

NODES = 16
BATCH = 1000
LOAD_BATCH = 16
SETTLE_TICKS = 50
"""Ticks after the compaction's file is written before the measurement ends."""


def _table(entries: int, rng: random.Random) -> Table:
    t = Table()
    for i in range(NODES):
        t.apply(RegisterNode(f"n{i}", "127.0.0.1", "", ("tcp",), 1, 600_000, 0))
    for b in range(entries // BATCH):
        hs = [rng.randbytes(8) for _ in range(BATCH)]
        t.apply(Publish(f"n{b % NODES}", 1, "ns", int(Tier.GPU), hs, [0] * BATCH,
                        [4096] * BATCH, [7] * BATCH, [1] * BATCH))  # fmt: skip
    return t


def _capture_479baed(t: Table) -> snapshot.Image:
    """The capture the Raft thread took before the copy-on-write one (the same copies)."""
    img = snapshot.freeze(t)
    meta = img._meta  # the node records: the same O(nodes) part as today's freeze
    c = t.col
    image = snapshot.Image(
        arrays=[a[:] for a in c.arrays()],
        keys=c.key[:],
        heads=[b.values() for b in t.blocks],  # type: ignore[misc]  # lists, as 479baed had
        meta=meta,
    )
    del img
    return image


def _run(t: Table, mode: str, tick_s: float, publish_every: int, rng: random.Random,
         path: str) -> dict[str, Any]:  # fmt: skip
    gaps: list[float] = []
    written = threading.Event()
    out: dict[str, float] = {}

    def write(frozen: snapshot.Frozen | None, image: snapshot.Image | None) -> None:
        if frozen is not None:
            image = frozen.image()
        assert image is not None
        # 479baed's write_to made each list of heads an array on the writer thread.
        image.heads = [h if isinstance(h, array) else array("I", h) for h in image.heads]
        snapshot.write(image, path, {}, [])
        snapshot.drop(image)
        written.set()

    ticks = 0
    after_written = 0
    started = False
    last = time.perf_counter()
    while after_written < SETTLE_TICKS:
        time.sleep(tick_s)
        now = time.perf_counter()
        if started:
            gaps.append(now - last)  # wake to wake: this thread's own work counts too
        last = now
        ticks += 1
        if ticks % publish_every == 0:
            hs = [rng.randbytes(8) for _ in range(LOAD_BATCH)]
            n = LOAD_BATCH
            t.apply(Publish(f"n{ticks % NODES}", 1, "ns", int(Tier.GPU), hs, [0] * n,
                            [4096] * n, [7] * n, [1] * n))  # fmt: skip
        if not started and ticks >= SETTLE_TICKS:
            started = True
            t0 = time.perf_counter()
            if mode == "before":
                args: tuple[Any, ...] = (None, _capture_479baed(t))
            else:
                args = (snapshot.freeze(t), None)
            out["capture_on_raft_thread_ms"] = (time.perf_counter() - t0) * 1000
            out["t0"] = t0
            threading.Thread(target=write, args=args, daemon=True).start()
        if written.is_set():
            if after_written == 0:
                out["compaction_s"] = time.perf_counter() - out["t0"]
            after_written += 1
    return {"gaps": gaps, **out}


def measure(sizes: list[int], tick_ms: float, publish_every: int, stall_ms: float,
            seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvdir-capture-stall-") as d:
        path = os.path.join(d, "snapshot.bin")
        for n in sizes:
            t = _table(n, rng)
            gc.collect()
            gc.freeze()  # as the daemons do after start-up
            for mode in ("before", "after"):
                r = _run(t, mode, tick_ms / 1000, publish_every, rng, path)
                gaps = r.pop("gaps")
                results.append(
                    {
                        "entries": t.entries,
                        "mode": mode,
                        "capture_on_raft_thread_ms": round(r["capture_on_raft_thread_ms"], 3),
                        "compaction_s": round(r["compaction_s"], 3),
                        "longest_tick_gap_ms": round(max(gaps) * 1000, 1),
                        f"gaps_over_{stall_ms:g}_ms": sum(g * 1000 > stall_ms for g in gaps),
                        "ticks": len(gaps),
                    }
                )
            del t
            gc.unfreeze()
            gc.collect()
    return {
        "tick_ms": tick_ms,
        "publish_every_ticks": publish_every,
        "publish_entries": LOAD_BATCH,
        "python": sys.version.split()[0],
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capture_stall", description=__doc__)
    p.add_argument("--entries", type=int, nargs="+", default=[1_000_000, 3_000_000])
    p.add_argument("--tick-ms", type=float, default=1.0, help="the Raft thread's wake period")
    p.add_argument("--publish-every", type=int, default=5, help="ticks between load publishes")
    p.add_argument("--stall-ms", type=float, default=50.0, help="count tick gaps over this")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if min(a.entries) < BATCH or a.tick_ms <= 0 or a.publish_every < 1:
        p.error(f"--entries at least {BATCH}, --tick-ms > 0, --publish-every >= 1")
    print(json.dumps(measure(a.entries, a.tick_ms, a.publish_every, a.stall_ms, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
