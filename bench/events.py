"""`kvdir bench events`: KV-event ingestion, decoded and enqueued on one core.

Payloads are what vLLM publishes: batches of BlockStored events (16 blocks of
16 tokens each, u64 hashes, about half >= 2^63) and BlockRemoved events, in
the map format of vLLM >= 0.24 and the positional one of vLLM <= 0.23. The
measured path is the consumer's whole per-message work after the socket:
sequence check, decode, hash normalisation, mirror update and the Publisher's
enqueue (its sending thread is not started, so no directory round trip is
timed). The baseline, measured in the same run on the same payloads, is a
bare `msgpack.unpackb`: the ratio says what kvdir adds on top of parsing.

Target: >= 100,000 block events/s on one core.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import time
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from kvdir import report
from kvdir.agent.events.consumer import RankConsumer
from kvdir.agent.events.holders import IndexHolders, _Holder
from kvdir.agent.publisher import NodeIdentity, Publisher, PublisherLimits
from kvdir.core.client import DirectoryClient, namespace

TARGET_BLOCKS_PER_S = 100_000
BLOCKS_PER_EVENT = 16
BLOCK_TOKENS = 16


def payloads(batches: int, positional: bool, seed: int = 7) -> tuple[list[bytes], int]:
    """(payloads, block events in them): 3 stores and 1 removal per batch."""
    rng = random.Random(seed)
    out, blocks = [], 0
    for _ in range(batches):
        events: list[Any] = []
        for kind in ("s", "s", "s", "r"):
            hs = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
            blocks += len(hs)
            if kind == "r":
                events.append(
                    ["BlockRemoved", hs, "GPU"]
                    if positional
                    else {"type": "BlockRemoved", "block_hashes": hs, "medium": "GPU"}
                )
                continue
            toks = [rng.randrange(128_000) for _ in range(BLOCKS_PER_EVENT * BLOCK_TOKENS)]
            events.append(
                ["BlockStored", hs, None, toks, BLOCK_TOKENS, None, "GPU", None]
                if positional
                else {
                    "type": "BlockStored",
                    "block_hashes": hs,
                    "parent_block_hash": None,
                    "token_ids": toks,
                    "block_size": BLOCK_TOKENS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        out.append(msgpack.packb([time.time(), events, 0], use_bin_type=True))
    return out, blocks


def _consumer() -> tuple[RankConsumer, Publisher]:
    client = DirectoryClient(["127.0.0.1:9"])  # never called: the sender is not started
    node = NodeIdentity("bench", "127.0.0.1", "", (), 10_000)
    limits = PublisherLimits(pending_max=50_000_000)
    holders = IndexHolders(client, node, "vllm", namespace("bench", BLOCK_TOKENS), limits=limits)
    pub = Publisher(client, NodeIdentity("bench/vllm/dp0", "127.0.0.1", "", (), 10_000), list)
    pub.limits = limits
    holders._holders[(0, "")] = _Holder(pub)
    return RankConsumer(holders, 0, "inproc://unused"), pub


def measure(batches: int, positional: bool) -> dict[str, Any]:
    data, blocks = payloads(batches, positional)
    t0 = time.perf_counter()
    for p in data:
        msgpack.unpackb(p, raw=False, strict_map_key=False)
    base_s = time.perf_counter() - t0
    consumer, pub = _consumer()
    frames = [[b"", i.to_bytes(8, "big"), p] for i, p in enumerate(data)]
    t0 = time.perf_counter()
    for f in frames:
        consumer.on_message(f)
    path_s = time.perf_counter() - t0
    st = consumer.stats
    assert st.decode_errors == 0 and st.gaps == 0 and pub.dropped == 0
    assert st.blocks_stored + st.blocks_removed == blocks
    return {
        "format": "positional (vLLM <= 0.23)" if positional else "map (vLLM >= 0.24)",
        "batches": batches,
        "block_events": blocks,
        "payload_bytes": sum(map(len, data)),
        "baseline_s": base_s,
        "kvdir_s": path_s,
        "baseline_blocks_per_s": blocks / base_s,
        "kvdir_blocks_per_s": blocks / path_s,
        "ratio_kvdir_to_baseline": path_s / base_s,
        "queued": pub.queue_depth,
    }


def run(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    results = [measure(args.batches, positional) for positional in (False, True)]
    head["wall_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    worst = min(r["kvdir_blocks_per_s"] for r in results)
    targets = [
        report.at_least(
            "blocks_per_s",
            "block events decoded and enqueued, one core",
            worst,
            TARGET_BLOCKS_PER_S,
            "blocks/s",
        )
    ]
    rows = [
        (
            r["format"],
            report.fmt(r["block_events"]),
            report.fmt(r["baseline_blocks_per_s"]),
            report.fmt(r["kvdir_blocks_per_s"]),
            f"{r['ratio_kvdir_to_baseline']:.2f}x",
        )
        for r in results
    ]
    md = (
        "\n\n".join(
            [
                "# kvdir bench events",
                report.header_markdown(head),
                __doc__ or "",
                report.targets_table(targets),
                report.table(
                    rows,
                    [
                        "Format",
                        "Block events",
                        "Baseline: msgpack.unpackb (blocks/s)",
                        "kvdir: decode + normalise + enqueue (blocks/s)",
                        "kvdir time / baseline time",
                    ],
                ),
            ]
        )
        + "\n"
    )
    stem = f"events-{started:%Y-%m-%d}"
    md_path, js_path = report.write(
        Path(args.out),
        stem,
        md,
        {"header": head, "targets": [t.as_dict() for t in targets], "results": results},
    )
    print(md)
    print(f"wrote {md_path} and {js_path}")
    return 0


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "events",
        help="KV-event ingestion throughput (decode + enqueue, one core)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batches", type=int, default=5_000, help="batches of 64 block events")
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    p.set_defaults(func=run)
