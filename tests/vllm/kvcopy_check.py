"""Run by tests/vllm/test_kvcopy_cpu.py under the vLLM CPU venv's Python (it has torch).

The CPU engine's block mover, vLLM's per-layer caches <-> pool slots, byte for
byte: real torch tensors and a real pool file, no engine. Two layouts of the
CPU backend's logical [B, H, N, C] views: contiguous blocks (moved as int64
rows) and strided ones (moved element-wise, the fallback). Exits non-zero with
the reason on the first mismatch.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from kvdir.agent.engine.vllm.kvcopy import BlockCopier, paired_runs, shape_of
from kvdir.agent.pool import KvPool

B, H, N, C, LAYERS = 12, 2, 16, 8, 3


def _caches(strided: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        if strided:  # [B, H, N, C] over an [B, N, H, C] buffer: a block is not one row
            t = torch.randn(B, N, H, C, generator=g).to(torch.bfloat16).permute(0, 2, 1, 3)
        else:
            t = torch.randn(B, H, N, C, generator=g).to(torch.bfloat16)
        out[f"layer.{i}"] = t
    return out


MOVES = [
    ([3, 7, 0, 11], [5, 2, 9, 14], [1, 4, 10, 6]),  # scattered: gathered and scattered
    ([2, 3, 4, 8, 9], [10, 11, 12, 0, 1], [5, 6, 7, 0, 1]),  # two runs: copied run by run
]


def check_runs() -> None:
    got = paired_runs([10, 11, 12, 0, 1, 5], [5, 6, 7, 0, 1, 3])
    if got != [(10, 5, 3), (0, 0, 2), (5, 3, 1)]:
        sys.exit(f"paired_runs: {got}")
    if paired_runs([], []) != [] or paired_runs([4, 5], [2, 9]) != [(4, 2, 1), (5, 9, 1)]:
        sys.exit("paired_runs: empty or broken destination run")


def check(strided: bool, base: Path) -> None:
    src, dst = _caches(strided, 1), _caches(strided, 2)
    shape = shape_of(src, "cpu")
    pool = KvPool.open(str(base / f"pool-{strided}"), "ns", shape.block_bytes, 16, fresh=True)
    try:
        save = BlockCopier(src, shape, pool)
        load = BlockCopier(dst, shape, pool)
        if (save._rows is None) is not strided:
            sys.exit(f"strided={strided}: int64 rows {'not ' if strided else ''}expected")
        for blocks, slots, into in MOVES:
            before = {name: t.clone() for name, t in dst.items()}
            save.to_pool(blocks, slots, [b"h%d" % b for b in blocks])
            load.from_pool(slots, into)
            untouched = [b for b in range(B) if b not in into]
            for name in src:
                if not torch.equal(dst[name][into], src[name][blocks]):
                    sys.exit(f"strided={strided} {blocks}: {name}: loaded blocks differ")
                if not torch.equal(dst[name][untouched], before[name][untouched]):
                    sys.exit(f"strided={strided} {blocks}: {name}: blocks outside the load changed")
        save.close()
        load.close()
    finally:
        pool.close(unlink=True)


if __name__ == "__main__":
    check_runs()
    with tempfile.TemporaryDirectory() as d:
        for strided in (False, True):
            check(strided, Path(d))
    print("ok")
