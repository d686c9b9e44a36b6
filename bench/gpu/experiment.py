"""Prefill versus fetch on GPUs: turn 1 on node A, turn 2 on node B.

    python -m bench.gpu.experiment --run 8b=1024,4096,8192 --run 70b:20=4096,8192 \\
        --gpu-a 0 --gpu-b 0 --out bench/results

For every shape, two engine processes (bench/gpu/node.py) start on GPUs
--gpu-a and --gpu-b (the same GPU for the one-GPU experiment; two GPUs for
the NVLink one). For every context length, A prefills turn 1 and announces
its blocks; B then measures its time to first token (TTFT) for turn 2
(context + --new tokens) three ways, each the median of --reps runs after one
warm-up:

- ``recompute``: prefill everything (no cache);
- ``tcp``: kvdir's tcp transport reads A's host-staged blocks into B's pool,
  B validates the headers, copies host->GPU and scatters into its paged
  slots, then prefills only the new tokens;
- ``cuda``: kvdir's cuda transport reads A's paged GPU blocks straight into
  B's paged slots (CUDA IPC, one kernel), B validates the headers, then
  prefills only the new tokens.

Also per context: one cudaMemcpy of the same bytes (the baseline of the cuda
read; from the peer GPU when --gpu-a != --gpu-b, i.e. the raw peer copy),
logits of the fetched runs against the recomputed ones, bitwise equality of
the KV that the tcp and cuda paths delivered, and an invalidation check (A
evicts a block; B's fetch must stop there).

Writes gpu-<date>.json, gpu-<date>.md and gpu-<date>.png (bench/gpu/report.py).
NVLink multicast stays off in the nodes' environment (NCCL_NVLS_ENABLE=0 etc.).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import selectors
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

CALL_TIMEOUT_S = 300.0
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class NodeError(RuntimeError):
    pass


class NodeProc:
    """A node process driven over its stdin/stdout (one JSON object per line)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self.sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def recv(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not self.sel.select(timeout_s):
            raise NodeError(f"node {self.name} did not answer within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise NodeError(f"node {self.name} exited (code {self.proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        if not msg.pop("ok"):
            raise NodeError(f"node {self.name}: {msg.get('error')}")
        return msg

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a dead node's stdin may be broken
                    pipe.close()


def parse_run(text: str) -> tuple[str, int, list[int]]:
    """'70b:20=4096,8192' -> ('70b', 20, [4096, 8192]); layers 0 = the full model."""
    try:
        head, ctx = text.split("=")
        shape, _, layers = head.partition(":")
        return shape, int(layers or 0), [int(c) for c in ctx.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad --run {text!r}: want SHAPE[:LAYERS]=N,N,..") from e


def run_shape(
    shape: str, layers: int, contexts: list[int], a: argparse.Namespace
) -> list[dict[str, Any]]:
    blocks = 2 * (-(-(max(contexts) + a.new) // a.block_size)) + 16
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    common = [
        sys.executable, "-m", "bench.gpu.node", "--shape", shape, "--layers", str(layers),
        "--blocks", str(blocks), "--block-size", str(a.block_size), "--pool-dir", a.pool_dir,
    ]  # fmt: skip
    node_a = NodeProc("A", [*common, "--name", "A", "--gpu", str(a.gpu_a)], env)
    node_b = NodeProc("B", [*common, "--name", "B", "--gpu", str(a.gpu_b)], env)
    rows = []
    gpu = a.gpu_a >= 0 and a.gpu_b >= 0
    try:
        hello_a, hello_b = node_a.recv(), node_b.recv()
        print(f"[{shape}] nodes up: A on {hello_a['gpu']}, B on {hello_b['gpu']}", flush=True)
        node_b.call("connect", peer=hello_a)
        for conv, n in enumerate(contexts):
            held = node_a.call("turn1", conv=conv, n=n)
            res = node_b.call(
                "turn2",
                conv=conv,
                n=n,
                new=a.new,
                held=held,
                modes=["recompute", "chunked", "tcp", "cuda"]
                if gpu
                else ["recompute", "chunked", "tcp"],
                reps=a.reps,
            )
            if gpu:
                res["fetch_only"] = node_b.call("fetch_only", held=held, reps=a.reps)
            k = len(held["blocks"]) // 3
            node_a.call("evict", conv=conv, index=k)
            res["invalidation"] = node_b.call("invalidation", held=held, evicted=k)
            node_a.call("release", conv=conv)
            res.update(
                shape=shape,
                layers=hello_a["layers"],
                full_layers=hello_a["full_layers"],
                context=n,
                new_tokens=a.new,
                holder_prefill_s=held["prefill_s"],
                holder_offload_s=held["offload_s"],
                gpu_a=a.gpu_a,
                gpu_b=a.gpu_b,
                pinned=hello_a["pinned"] and hello_b["pinned"],
                gpu=hello_b["gpu"],
                torch=hello_b["torch"],
            )
            rows.append(res)
            if not gpu:
                print(f"[{shape}] {n} tokens (cpu dry run): {json.dumps(res)[:2000]}", flush=True)
                continue
            print(
                f"[{shape}] {n} tokens: recompute {res['recompute']['ttft_s'] * 1e3:.1f} ms, "
                f"tcp {res['tcp']['ttft_s'] * 1e3:.1f} ms, cuda {res['cuda']['ttft_s'] * 1e3:.1f}"
                f" ms (read {res['fetch_only']['read_s'] * 1e3:.2f} ms vs bare "
                f"{res['bare_copy']['ipc_s'] * 1e3:.2f} ms)",
                flush=True,
            )
    finally:
        node_a.stop()
        node_b.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_args(ap.parse_args(argv))


def _command_line() -> str:
    """How this run was started: `kvdir bench gpu ...` or the module itself."""
    prog = os.path.basename(sys.argv[0])
    if prog == "kvdir":
        return shlex.join(["kvdir", *sys.argv[1:]])
    return "python -m bench.gpu.experiment " + shlex.join(sys.argv[1:])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The experiment's flags (shared with `kvdir bench gpu`)."""
    ap.add_argument("--run", type=parse_run, action="append", help="SHAPE[:LAYERS]=N,N,..")
    ap.add_argument(
        "--gpu-a", type=int, default=0, help="node A's GPU (the holder); -1: CPU dry run"
    )
    ap.add_argument("--gpu-b", type=int, default=0, help="node B's GPU (the reader)")
    ap.add_argument("--new", type=int, default=64, help="new tokens of turn 2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-dir", default="/dev/shm")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="gpu")


def run_args(a: argparse.Namespace) -> int:
    runs = a.run or [("8b", 0, [1024, 4096, 8192]), ("70b", 20, [4096, 8192])]
    for shape, _, contexts in runs:
        if any(c % a.block_size for c in contexts):
            print(f"contexts must be multiples of the block size {a.block_size}", file=sys.stderr)
            return 2
        del shape
    started = time.time()
    rows: list[dict[str, Any]] = []
    for shape, layers, contexts in runs:
        rows.extend(run_shape(shape, layers, contexts, a))
    stamp = datetime.now(UTC)
    doc = {
        "kind": "gpu",
        "date": stamp.isoformat(timespec="seconds"),
        "command": _command_line(),
        "host": platform.node(),
        "python": platform.python_version(),
        "seconds": time.time() - started,
        "rows": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"{a.tag}-{stamp:%Y-%m-%d}")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    if all("cuda" in r for r in rows):
        from bench.gpu.report import write_report

        write_report(doc, base)
    print(f"wrote {base}.json/.md/.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
