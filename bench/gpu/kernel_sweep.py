"""Which copy kernel moves scattered paged-KV blocks fastest? (one GPU, one process)

    python -m bench.gpu.kernel_sweep [--out DIR]

Workload: the 8B shape's 8k-token fetch, 512 blocks x 32 layers x K/V = 32,768
segments of 32 KiB, random source and destination blocks in two caches of
1,100 blocks; and the 1k-token fetch (64 blocks). Each variant is timed with
CUDA events (median of 20 after 3 warm-ups) against one cudaMemcpy of the same
bytes, and its result is checked against the first variant's. This is how
transfer/cuda_ipc.py's kernel was chosen; results: bench/results/gpu-kernels-*.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from typing import Any

import numpy as np

_COMMON = r"""
struct __align__(16) v16 { unsigned long long lo, hi; };
template <int U>
__device__ __forceinline__ void copy_u(const v16* __restrict__ s, v16* __restrict__ d,
                                       long long words, int tid, int nthr) {
    long long k = tid;
    for (; k + (U - 1) * (long long)nthr < words; k += U * (long long)nthr) {
        v16 r[U];
#pragma unroll
        for (int u = 0; u < U; u++) r[u] = s[k + u * nthr];
#pragma unroll
        for (int u = 0; u < U; u++) d[k + u * nthr] = r[u];
    }
    for (; k < words; k += nthr) d[k] = s[k];
}
__device__ __forceinline__ void addr(long long id, long long n, unsigned long long sb,
        unsigned long long db, const long long* b, long long seg, long long sl, long long sk,
        long long dl, long long dk, const v16** s, v16** d) {
    const long long plane = id / n, i = id - plane * n, layer = plane >> 1, kv = plane & 1;
    *s = (const v16*)(sb + layer * sl + kv * sk + b[i] * seg);
    *d = (v16*)(db + layer * dl + kv * dk + b[n + i] * seg);
}
#define ARGS unsigned long long sb, unsigned long long db, const long long* __restrict__ b, \
    long long n, long long planes, long long seg, long long sl, long long sk, long long dl, \
    long long dk
"""

VARIANTS = {
    # one thread block per segment
    "block_u4": (
        'extern "C" __global__ void k(ARGS) { long long id = blockIdx.x;'
        " if (id >= planes * n) return; const v16* s; v16* d;"
        " addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " copy_u<4>(s, d, seg >> 4, threadIdx.x, blockDim.x); }",
        "segments",
        256,
    ),
    "block_u8": (
        'extern "C" __global__ void k(ARGS) { long long id = blockIdx.x;'
        " if (id >= planes * n) return; const v16* s; v16* d;"
        " addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " copy_u<8>(s, d, seg >> 4, threadIdx.x, blockDim.x); }",
        "segments",
        256,
    ),
    "block512_u4": (
        'extern "C" __global__ void k(ARGS) { long long id = blockIdx.x;'
        " if (id >= planes * n) return; const v16* s; v16* d;"
        " addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " copy_u<4>(s, d, seg >> 4, threadIdx.x, blockDim.x); }",
        "segments",
        512,
    ),
    # a fixed grid of thread blocks looping over segments
    "persist_u8": (
        'extern "C" __global__ void k(ARGS) {'
        " for (long long id = blockIdx.x; id < planes * n; id += gridDim.x) {"
        " const v16* s; v16* d; addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " copy_u<8>(s, d, seg >> 4, threadIdx.x, blockDim.x); } }",
        "persistent",
        256,
    ),
    # one warp per segment, 8 warps per block
    "warp_u8": (
        'extern "C" __global__ void k(ARGS) {'
        " long long id = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);"
        " if (id >= planes * n) return; const v16* s; v16* d;"
        " addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " copy_u<8>(s, d, seg >> 4, threadIdx.x & 31, 32); }",
        "warps",
        256,
    ),
    # one thread block per half segment (more, shorter blocks)
    "half_u4": (
        'extern "C" __global__ void k(ARGS) { long long id = blockIdx.x >> 1;'
        " if (id >= planes * n) return; const v16* s; v16* d;"
        " addr(id, n, sb, db, b, seg, sl, sk, dl, dk, &s, &d);"
        " long long h = (seg >> 5) * (blockIdx.x & 1);"
        " copy_u<4>(s + h, d + h, seg >> 5, threadIdx.x, blockDim.x); }",
        "halves",
        256,
    ),
}


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    layers, blocks, seg = 32, 1100, 32 << 10
    plane = blocks * seg
    span = layers * 2 * plane
    src = cp.random.randint(0, 255, span, dtype=cp.uint8)
    dst = cp.zeros(span, dtype=cp.uint8)
    flat = cp.empty(span, dtype=cp.uint8)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for n in (64, 512):
        s_blocks = rng.choice(blocks, n, replace=False)
        d_blocks = rng.choice(blocks, n, replace=False)
        ids = cp.asarray(np.concatenate([s_blocks, d_blocks]).astype(np.int64))
        nbytes = n * 2 * layers * seg

        def timed(fn: Any) -> float:
            for _ in range(3):
                fn()
            ts = []
            for _ in range(a.reps):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
            return float(statistics.median(ts))

        bare = timed(
            lambda nb=nbytes: cp.cuda.runtime.memcpyAsync(
                flat.data.ptr, src.data.ptr, nb, 3, cp.cuda.Stream.null.ptr
            )
        )
        row: dict[str, Any] = {"blocks": n, "segments": n * 2 * layers, "bytes": nbytes}
        row["bare_memcpy_s"] = bare
        reference = None
        for name, (body, grid_kind, threads) in VARIANTS.items():
            try:
                kern = cp.RawKernel(_COMMON + body, "k", options=("--std=c++14",))
                total = n * 2 * layers
                grid = {
                    "segments": total,
                    "persistent": min(total, sms * (2048 // threads)),
                    "warps": -(-total // (threads // 32)),
                    "halves": 2 * total,
                }[grid_kind]
                args = (
                    np.uint64(src.data.ptr),
                    np.uint64(dst.data.ptr),
                    ids,
                    np.int64(n),
                    np.int64(2 * layers),
                    np.int64(seg),
                    np.int64(2 * plane),
                    np.int64(plane),
                    np.int64(2 * plane),
                    np.int64(plane),
                )
                dst.fill(0)
                t = timed(lambda k=kern, g=grid, th=threads, ar=args: k((g,), (th,), ar))
                digest = int(cp.asnumpy(dst.view(cp.uint64).sum()))
                if reference is None:
                    reference = digest
                row[name] = {"s": t, "vs_bare": t / bare, "same_bytes": digest == reference}
            except Exception as e:  # a variant that fails to build is reported, not fatal
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(n, name, row[name], flush=True)
        rows.append(row)
    doc = {
        "kind": "gpu-kernels",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.gpu.kernel_sweep",
        "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "rows": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"gpu-kernels-{datetime.now(UTC):%Y-%m-%d}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
