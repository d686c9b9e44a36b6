"""Prefix-chained block hashes of a token sequence (xxhash3, 64-bit).

Block i's hash covers block i's tokens *and* block i-1's hash, so equal hashes
mean equal prefixes, as in vLLM's and SGLang's prefix caches. Engines that
publish their own hashes keep them; this is for callers that start from
tokens (the demo, the benchmarks, a gateway without engine hashes).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

ROOT_SEED = 0x6B76646972  # "kvdir": distinguishes our chains from other users of xxh3


def block_chain(tokens: Sequence[int], block_tokens: int, seed: int = ROOT_SEED) -> list[bytes]:
    """8-byte big-endian hashes of each *full* block of `tokens`."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    out: list[bytes] = []
    parent = struct.pack(">Q", seed)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens]
        h = xxhash.xxh3_64_digest(parent + struct.pack(f"<{block_tokens}I", *block))
        out.append(h)
        parent = h
    return out
