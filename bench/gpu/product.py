"""Prefill versus fetch through the product GPU path: two nodes on one GPU.

    python -m bench.gpu.product --run 8b=1024,4096,8192 --run 70b:20=4096,8192 --out bench/results

Starts a directory (one replica, `kvdir directory serve`), two agents
(`kvdir agent serve`, transports tcp,shm,cuda, one pool of tier gpu) and two
engine workers (bench/gpu/product_node.py: vLLM-shaped per-layer KV caches,
the engine library, the GPU mover). For every context length, node A
prefills turn 1 and saves it through its GPU tier (side stream; announced
after completion); node B then measures turn 2's TTFT by recomputing and by
fetching through kvdir (lookup, reserve, Fetch by its agent over CUDA IPC
with header validation, load of its tier slots into its vLLM blocks, prefill
of the new tokens), next to one bare cudaMemcpy of the same bytes. Checks:
B's fetched blocks are byte-identical to A's; a block A reuses after the
directory recorded it ends B's valid prefix exactly there; the worker's own
seqlock catches a slot reused between lookup and load.

Writes product-<date>.json and product-<date>.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from bench.gpu.experiment import NO_MULTICAST, NodeProc, parse_run
from bench.gpu.model import SHAPES
from kvdir.local import LocalAgent, LocalCluster, wait_for

BLOCK_TOKENS = 16
WAIT_S = 60.0


def block_bytes(shape: str, layers: int) -> int:
    s = SHAPES[shape].with_layers(layers or SHAPES[shape].layers)
    return 2 * s.layers * BLOCK_TOKENS * s.kv_heads * s.head_dim * 2


def pool_spec(shape: str, layers: int, slots: int) -> str:
    return (
        f"model=kvdir-gpu-{shape},block_tokens={BLOCK_TOKENS},dtype=bf16,layout=vllm-flash,"
        f"slot_bytes={block_bytes(shape, layers)},slots={slots},tier=gpu,gpu_device=0"
    )


class Nodes:
    """The directory, two agents and two workers of one shape."""

    def __init__(self, base: str, shape: str, layers: int, max_tokens: int) -> None:
        blocks = 2 * (-(-max_tokens // BLOCK_TOKENS)) + 64
        self.cluster = LocalCluster(os.path.join(base, "directory"), size=1)
        self.cluster.start(timeout_s=60)
        spec = pool_spec(shape, layers, blocks)
        # An agent that outlives its SIGTERM deadline is sent SIGABRT: with the fault
        # handler on, its threads' stacks land in its log (stop() returns the tail).
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        self.agents = [
            LocalAgent(n, base, self.cluster.grpc_addresses, spec, "tcp,shm,cuda", 60_000)
            for n in ("node-a", "node-b")
        ]
        for a in self.agents:
            a.launch(timeout_s=120)
        env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
        self.workers = []
        for a, name in zip(self.agents, "AB", strict=True):
            argv = [
                sys.executable, "-m", "bench.gpu.product_node", "--name", name,
                "--socket", a.engine_socket, "--shape", shape, "--layers", str(layers),
                "--blocks", str(blocks),
            ]  # fmt: skip
            self.workers.append(NodeProc(name, argv, env))
        self.hello = [w.recv() for w in self.workers]

    def stop(self) -> dict[str, Any]:
        """Readers first (B's agent maps A's GPU memory); what each agent logged last,
        and any agent that did not exit within its SIGTERM deadline (then killed)."""
        out: dict[str, Any] = {"shutdown_hangs": []}
        for w in reversed(self.workers):
            w.stop()
        for a in reversed(self.agents):
            try:
                a.stop()
            except subprocess.TimeoutExpired:
                out["shutdown_hangs"].append(a.node_id)
                a.kill(signal.SIGABRT)
            with open(a.log_path, errors="replace") as fh:
                out[f"{a.node_id}_log_tail"] = fh.readlines()[-60:]
        self.cluster.stop()
        return out


def run_context(nodes: Nodes, conv: int, n: int, new: int, reps: int) -> dict[str, Any]:
    a, b = nodes.workers
    held = a.call("turn1", conv=conv, n=n)
    nb = len(held["hashes"])

    def published() -> bool:
        return int(b.call("peek", hashes=held["hashes"])["peer_blocks"]) >= nb

    wait_for(published, WAIT_S, "node B's lookup to see node A's blocks", 0.01)
    res = b.call("turn2", conv=conv, n=n, new=new, hashes=held["hashes"], reps=reps)
    res["byte_identical"] = res.pop("digests") == held["digests"]
    k = nb // 3
    a.call("reuse", conv=conv, index=k)
    race = b.call("race", hashes=held["hashes"])
    race["reused_index"] = k
    race["detected"] = race["valid"] == k and race["invalidated"] == nb - k
    res["race"] = race
    a.call("release", conv=conv)
    res.update(
        context=n,
        new_tokens=new,
        holder_save_call_s=held["save_call_s"],
        holder_save_done_s=held["save_done_s"],
    )
    return res


def run_shape(shape: str, layers: int, contexts: list[int], a: argparse.Namespace) -> list[Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvdir-gpu-product-", dir=a.pool_dir) as base:
        nodes = Nodes(base, shape, layers, max(contexts) + a.new)
        try:
            hello = nodes.hello[1]
            local = nodes.workers[1].call("local_race", count=8, index=3)
            for conv, n in enumerate(contexts):
                r = run_context(nodes, conv, n, a.new, a.reps)
                r.update(shape=shape, layers=hello["layers"], full_layers=hello["full_layers"])
                r.update(gpu=hello["gpu"], torch=hello["torch"], local_race=local)
                rows.append(r)
                f = r["fetch"]
                print(
                    f"[{shape}] {n}: recompute {r['recompute']['ttft_s'] * 1e3:.1f} ms, kvdir "
                    f"{f['ttft_s'] * 1e3:.1f} ms (fetch {f['fetch_s'] * 1e3:.2f} ms = rpc "
                    f"{f['fetch_rpc_s'] * 1e3:.2f} + load {f['load_s'] * 1e3:.2f}; bare "
                    f"{r['bare_copy_s'] * 1e3:.2f} ms) identical={r['byte_identical']} "
                    f"race={r['race']['detected']}",
                    flush=True,
                )
        finally:
            stopped = nodes.stop()
    for r in rows:
        r["shutdown"] = stopped
    return rows


def write_md(doc: dict[str, Any], path: str) -> None:
    lines = [
        f"# GPU product path, {doc['date']}",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {doc['rows'][0]['gpu'] if doc['rows'] else '?'}, torch "
        f"{doc['rows'][0]['torch'] if doc['rows'] else '?'}, host {doc['host']}",
        "",
        "| shape, context | KV | recompute TTFT | kvdir TTFT | fetch: RPC + load | lookup |"
        " data path: agent read + load | bare copy | data / bare | fetch / bare |"
        " load kernel / bare | identical | race caught |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        f, ms = r["fetch"], 1e3
        lines.append(
            f"| {r['shape']} ({r['layers']} layers), {r['context']:,} | {r['bytes'] / 1e6:,.0f} MB"
            f" | {r['recompute']['ttft_s'] * ms:.1f} ms | {f['ttft_s'] * ms:.1f} ms"
            f" | {f['fetch_s'] * ms:.2f} ({f['fetch_rpc_s'] * ms:.2f} + {f['load_s'] * ms:.2f}) ms"
            f" | {f['lookup_s'] * ms:.2f} ms"
            f" | {f['data_path_s'] * ms:.2f} ({f['agent_read_s'] * ms:.2f}"
            f" + {f['load_s'] * ms:.2f}) ms | {r['bare_copy_s'] * ms:.2f} ms"
            f" | {f['data_path_s'] / r['bare_copy_s']:.2f}x"
            f" | {f['fetch_s'] / r['bare_copy_s']:.2f}x"
            f" | {r['load_kernel_s'] / r['bare_copy_s']:.2f}x"
            f" | {r['byte_identical']} | {r['race']['detected']} |"
        )
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=parse_run, action="append", help="SHAPE[:LAYERS]=N,N,..")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pool-dir", default="/dev/shm")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="gpu-product")
    a = ap.parse_args(argv)
    runs = a.run or [("8b", 0, [1024, 4096, 8192]), ("70b", 20, [4096, 8192])]
    started = time.time()
    rows = []
    for shape, layers, contexts in runs:
        rows += run_shape(shape, layers, contexts, a)
    stamp = datetime.now(UTC)
    doc = {
        "kind": "gpu-product",
        "date": stamp.isoformat(timespec="seconds"),
        "command": "python -m bench.gpu.product "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "host": platform.node(),
        "seconds": time.time() - started,
        "rows": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"{a.tag}-{stamp:%Y-%m-%d}")
    with open(base + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    write_md(doc, base + ".md")
    print(f"wrote {base}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
