"""A client-side mirror as a chaos reader: its reads go into the history as mode "mirror".

One `Mirror` fed by `MirrorSync` over every replica (it resumes on another
when its replica dies or is partitioned away); the reader asks it what the
local readers ask a replica. Each answered read records the mirror's applied
index (what the answer reflects) and the commit index it had heard of, so
the checker can tell that its reads never go backwards and never come from
past the commit index (bench/chaos/checker.py). A stale mirror answers
nothing: that read is recorded as failed, as an unavailable replica's is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from bench.chaos.history import Op
from kvdir.core.mirror import Mirror, NotServed
from kvdir.core.mirror_sync import MirrorSync
from kvdir.v1 import directory_pb2 as pb

MAX_STALENESS_S = 2.0
"""Past this the mirror refuses (its reads then count as unavailable)."""


def read_once(
    m: Mirror,
    rec: Callable[[Op], None],
    process: str,
    picks: Sequence[tuple[int, int]],
    space: pb.Namespace,
    hash_of: Callable[[int, int], bytes],
    key_of: Callable[[int, int], str],
    decode: Callable[[int, int, Sequence[pb.NodeMatch]], tuple[int | None, str]],
) -> None:
    lookups = [pb.LookupRequest(namespace=space, block_hashes=[hash_of(o, k)]) for o, k in picks]
    t0 = time.monotonic()
    try:
        resp = m.lookup_batch(lookups)
    except NotServed:
        t1 = time.monotonic()
        for o, k in picks:
            rec(Op(process, "read", key_of(o, k), t0, t1, "fail", mode="mirror"))
        return
    commit = m.commit_index  # read after the answer: at least what it had heard then
    t1 = time.monotonic()
    for i, (o, k) in enumerate(picks):
        value, bad = decode(o, k, resp.results[i].matches)
        rec(
            Op(
                process,
                "read",
                key_of(o, k),
                t0,
                t1,
                "ok",
                value=value,
                mode="mirror",
                replica=process,
                applied_index=resp.read.applied_index,
                commit_index=commit,
                last_attempt=t0,
                bad_record=bad,
            )
        )


def mirror_loop(
    addresses: Sequence[str],
    process: str,
    agents: int,
    keys: int,
    batch: int,
    pace_s: float,
    rec: Callable[[Op], None],
    stop: Callable[[], bool],
    seed: int,
    read: Callable[[Mirror, Sequence[tuple[int, int]]], None],
) -> None:
    rng = random.Random(seed)
    m = Mirror(max_staleness_s=MAX_STALENESS_S)
    with MirrorSync(m, addresses):
        while not stop():
            picks = [(rng.randrange(agents), rng.randrange(keys)) for _ in range(batch)]
            read(m, list(dict.fromkeys(picks)))
            time.sleep(pace_s)
