"""The connector's load path at the agent: fetch on the lookup's ticket, or look up again.

Run as ``python -m bench.vllm.ticket [--tokens 1024 2048] [--reps 15]``. A
real 3-replica directory on 127.0.0.1 and three real agents (`kvdir agent
serve`): a holds each prefix (the `kvdir bench vllm` model's blocks: 8
layers, 128 KiB per 32-token block), b reads it over tcp, c over shm, d over
tcp with its directory mirror off (its lookups are replica RPCs). Per rep and
reader, interleaved so the host's drift hits both alike, what the
connector's worker does for a peer load:

- ``ticket``: the scheduler side's Lookup (which now answers with a load
  ticket), then Fetch on that ticket (no directory lookup in the agent);
- ``chain``: the same Lookup, then Fetch by chain (the agent looks the chain
  up again: the path before load tickets, kept for callers without one).

Times are wall clock from the engine's side of the Unix socket (Lookup and
Fetch separately) and the agent's own fetch seconds. Every fetch must be
whole and byte-identical to the holder's blocks; destinations are freed,
never announced. Writes bench/results/vllm-ticket-DATE.{md,json} (or
--out-dir).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.measure import say
from bench.vllm.model import BLOCK_TOKENS, Shape, pool_spec
from kvdir import report
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import namespace
from kvdir.core.hashing import block_chain
from kvdir.local import LocalAgent, LocalCluster, wait_for
from kvdir.v1 import directory_pb2 as pb

SLOTS = 1024
WAIT_S = 60.0
FETCH_TIMEOUT_MS = 30_000
READERS = {"b": "tcp", "c": "tcp,shm", "d": "tcp"}
"""Reader -> transports; d runs with its directory mirror off (each lookup a replica RPC)."""
MIRROR_OFF = {"d"}
TRANSPORT = {"b": "tcp", "c": "shm", "d": "tcp, no mirror"}


def _start(base: str, shape: Shape) -> tuple[LocalCluster, dict[str, LocalAgent]]:
    cluster = LocalCluster(os.path.join(base, "directory"), size=3)
    cluster.start(timeout_s=WAIT_S)
    spec = pool_spec(shape, SLOTS)
    agents = {
        n: LocalAgent(
            n,
            base,
            cluster.grpc_addresses,
            spec,
            transports=t,
            lease_ms=15_000,
            extra_args=["--no-directory-mirror"] if n in MIRROR_OFF else [],
        )
        for n, t in (("a", "tcp,shm"), *READERS.items())
    }
    for a in agents.values():
        a.launch(WAIT_S)
    return cluster, agents


def _store(a: EngineClient, ns: pb.Namespace, chain: list[bytes], seed: int) -> list[bytes]:
    slots = a.allocate(ns, len(chain)).slots
    payload = []
    for i, s in enumerate(slots):
        view = a.slot_view(ns, s)
        block = ((seed * 1_000_003 + i).to_bytes(8, "little") * (len(view) // 8))[: len(view)]
        view[:] = block
        payload.append(block)
    a.stored(ns, chain, slots)
    a.flush()
    return payload


def _wait_seen(c: EngineClient, ns: pb.Namespace, chain: list[bytes]) -> None:
    def seen() -> bool:
        return any(p.prefix_blocks >= len(chain) for p in c.lookup(ns, chain).peers)

    wait_for(seen, WAIT_S, f"the readers to see a's {len(chain)} blocks", 0.05)


def _one(
    c: EngineClient, ns: pb.Namespace, chain: list[bytes], payload: list[bytes], ticket: bool
) -> dict[str, float]:
    t0 = time.perf_counter()
    found = c.lookup(ns, chain)
    t1 = time.perf_counter()
    slots = c.allocate(ns, len(chain), evict=True).slots
    t2 = time.perf_counter()
    r = c.fetch(ns, chain, slots, FETCH_TIMEOUT_MS, ticket=found.ticket if ticket else b"")
    t3 = time.perf_counter()
    ok = r.valid_blocks == len(chain) and all(
        bytes(c.slot_view(ns, s)) == p for s, p in zip(slots, payload, strict=True)
    )
    c.free(ns, slots)
    if not ok:
        raise RuntimeError(f"a fetch was not whole or not byte-identical ({r.valid_blocks} valid)")
    return {"lookup_s": t1 - t0, "fetch_s": t3 - t2, "agent_s": r.seconds, "bytes": r.bytes}


def measure(
    agents: dict[str, LocalAgent], shape: Shape, tokens: list[int], reps: int
) -> dict[str, Any]:
    ns = namespace(shape.name, BLOCK_TOKENS, "bf16", shape.layout, 0, 1)
    holder = EngineClient(agents["a"].engine_socket)
    readers = {n: EngineClient(agents[n].engine_socket) for n in READERS}
    rows: list[dict[str, Any]] = []
    try:
        for k, n_tokens in enumerate(tokens):
            blocks = n_tokens // BLOCK_TOKENS
            chain = block_chain(list(range(k * 10**6, k * 10**6 + n_tokens)), BLOCK_TOKENS)
            payload = _store(holder, ns, chain, k)
            for c in readers.values():
                _wait_seen(c, ns, chain)
            got: dict[tuple[str, str], list[dict[str, float]]] = {}
            for rep in range(reps + 1):  # the first round warms up (handshakes, pages)
                for name, c in readers.items():
                    for ticket in (rep % 2 == 0, rep % 2 == 1):
                        m = _one(c, ns, chain, payload, ticket)
                        if rep:
                            got.setdefault((name, "ticket" if ticket else "chain"), []).append(m)
            for (name, form), ms in sorted(got.items()):
                rows.append(_row(n_tokens, blocks, name, form, ms))
                say(f"{n_tokens} tokens, reader {name}, {form}: {rows[-1]}")
    finally:
        holder.close()
        for c in readers.values():
            c.close()
    return {"rows": rows, "reps": reps, "block_bytes": shape.block_bytes}


def _row(
    tokens: int, blocks: int, reader: str, form: str, ms: list[dict[str, float]]
) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(m[key] for m in ms) * 1e3

    fetch = med("fetch_s")
    nbytes = ms[0]["bytes"]
    return {
        "tokens": tokens,
        "blocks": blocks,
        "reader": reader,
        "transport": TRANSPORT[reader],
        "form": form,
        "lookup_ms_p50": med("lookup_s"),
        "fetch_ms_p50": fetch,
        "agent_fetch_ms_p50": med("agent_s"),
        "lookup_plus_fetch_ms_p50": statistics.median(
            (m["lookup_s"] + m["fetch_s"]) * 1e3 for m in ms
        ),
        "bytes": nbytes,
        "fetch_gb_per_s": nbytes / fetch / 1e6 if fetch else 0.0,
    }


def markdown(h: dict[str, Any], res: dict[str, Any]) -> str:
    head = [
        "tokens", "MiB", "transport", "form", "Lookup p50 ms", "Fetch p50 ms",
        "agent's fetch p50 ms", "Lookup+Fetch p50 ms", "Fetch GB/s",
    ]  # fmt: skip
    rows = [
        [
            r["tokens"], r["bytes"] / 2**20, r["transport"], r["form"], r["lookup_ms_p50"],
            r["fetch_ms_p50"], r["agent_fetch_ms_p50"], r["lookup_plus_fetch_ms_p50"],
            r["fetch_gb_per_s"],
        ]
        for r in res["rows"]
    ]  # fmt: skip
    method = (
        f"{res['reps']} reps per row after one warm-up round, the two forms alternating "
        "first; medians. `ticket`: Fetch on the Lookup's load ticket (no directory lookup "
        "in the agent); `chain`: Fetch by chain (the agent looks the chain up again: in its "
        "mirror, or, for the reader without one, a replica RPC). Every fetch whole and "
        "byte-identical. Load average at the end: "
        + " / ".join(f"{x:.2f}" for x in h["loadavg_end"])
        + " (a loaded host: figures are for comparing the two forms side by side)."
    )
    title = "# The connector's load path at the agent: one lookup per load (load tickets)"
    return "\n\n".join([title, report.header_markdown(h), method, report.table(rows, head)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm.ticket",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out-dir", help="where vllm-ticket-DATE.{md,json} go (bench/results)")
    args = p.parse_args(argv)
    out_dir = args.out_dir or str(Path(__file__).parents[1] / "results")
    started = dt.datetime.now(dt.UTC)
    h = report.header(started)
    h["command"] = "python -m bench.vllm.ticket " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    shape = Shape()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvdir-ticket-") as base:
        say("starting 3 replicas and 3 agents on 127.0.0.1")
        cluster, agents = _start(base, shape)
        try:
            res = measure(agents, shape, args.tokens, args.reps)
        finally:
            for a in agents.values():
                a.stop()
            cluster.stop()
    h["wall_s"] = time.monotonic() - t0
    h["loadavg_end"] = os.getloadavg()
    md = markdown(h, res)
    report.write(Path(out_dir), f"vllm-ticket-{started:%Y-%m-%d}", md, {**h, **res})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
