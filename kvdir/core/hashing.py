"""Prefix-chained block hashes of a token sequence: the keys the directory holds.

Block i's hash covers block i's tokens *and* block i-1's hash, so equal hashes
mean equal prefixes. Three schemes produce the keys agents publish:

- **kvdir** (`block_chain`): xxhash3-64 over the parent and the tokens; what
  kvdir's own agents, the demo and the benchmarks publish.
- **vLLM** (`vllm_block_digests`, `vllm_keys`): v1 prefix caching,
  ``h_i = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), None))`` with H
  one of sha256 (pickle), sha256_cbor, xxhash, xxhash_cbor; the agent indexes
  the low 64 bits (int events, the default) or the whole digest.
- **SGLang** (`sglang_page_digests`, `sglang_keys`): SHA-256 over the parent
  digest (none for the first page) and the page's token ids as little-endian
  uint32; events carry the first 8 digest bytes as an int64, which the agent
  indexes as those 8 bytes.

Pure functions, importable by the agent (its hash self-test) and by the
gateway (lookups from tokens), so both compute exactly the same keys.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

ROOT_SEED = 0x6B76646972  # "kvdir": distinguishes our chains from other users of xxh3


class HashSchemeError(ValueError):
    """A hash scheme cannot be computed as configured (the message says why)."""


def _u32le(tokens: Sequence[int]) -> bytes:
    """The tokens as little-endian uint32 bytes (struct.error when one is out of range)."""
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4:
        return (
            tokens.tobytes()
            if sys.byteorder == "little"
            else struct.pack(f"<{len(tokens)}I", *tokens)
        )
    if sys.byteorder == "little":
        try:
            return array("I", tokens).tobytes()  # one C pass instead of a pack per block
        except (OverflowError, TypeError) as e:
            raise struct.error(str(e)) from None
    return struct.pack(f"<{len(tokens)}I", *tokens)


def block_chain(tokens: Sequence[int], block_tokens: int, seed: int = ROOT_SEED) -> list[bytes]:
    """8-byte big-endian hashes of each *full* block of `tokens`."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    out: list[bytes] = []
    parent = struct.pack(">Q", seed)
    full = len(tokens) - len(tokens) % block_tokens
    data = _u32le(tokens[:full])
    digest = xxhash.xxh3_64_digest
    append = out.append
    # iter_unpack cuts the blocks in C: ~30% less per block than slicing in the loop
    for (block,) in struct.iter_unpack(f"{4 * block_tokens}s", data):
        parent = digest(parent + block)
        append(parent)
    return out


# ---------------------------------------------------------------- vLLM

VLLM_DEFAULT_SEED = "vllm-none-hash"
VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_VLLM_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def vllm_hash_fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return _VLLM_FNS[algo]
    except KeyError:
        raise HashSchemeError(f"unknown hash algorithm {algo!r} (one of {VLLM_ALGOS})") from None


def vllm_none_hash(algo: str, seed: str = "") -> bytes:
    """vLLM's NONE_HASH: the parent of every prefix's first block."""
    if not seed and algo.startswith("xxhash"):
        raise HashSchemeError(
            f"{algo} without PYTHONHASHSEED uses a random per-process seed: its hashes "
            "cannot be recomputed; set PYTHONHASHSEED on the engine and give it as the seed"
        )
    return vllm_hash_fn(algo)(seed or VLLM_DEFAULT_SEED)


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    seed: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """The digests of each full block of `tokens` (no extra keys)."""
    if block_size <= 0:
        raise HashSchemeError("block_size must be > 0")
    fn = vllm_hash_fn(algo)
    prev = parent if parent is not None else vllm_none_hash(algo, seed)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = fn((prev, tuple(tokens[start : start + block_size]), None))
        out.append(prev)
    return out


def vllm_keys(digests: Sequence[bytes], int_hashes: bool) -> list[bytes]:
    """Directory keys of the hashes vLLM publishes for these digests (low 64 bits or all)."""
    return [d[-8:] for d in digests] if int_hashes else list(digests)


# -------------------------------------------------------------- SGLang

_U32_MAX = (1 << 32) - 1


def sglang_page_digests(
    tokens: Sequence[int], page_size: int, prior: bytes | None = None
) -> list[bytes]:
    """SHA-256 digests of each full page: H(parent digest | tokens as little-endian u32)."""
    if page_size <= 0:
        raise HashSchemeError("page_size must be > 0")
    if prior is not None and len(prior) != 32:
        raise HashSchemeError("an SGLang prior digest is exactly 32 bytes")
    out: list[bytes] = []
    prev = prior or b""
    full = len(tokens) - len(tokens) % page_size
    try:
        data = _u32le(tokens[:full])
    except struct.error:
        # SGLang switches to a tagged 64-bit page encoding for ids past u32;
        # no tokenizer in use produces them, so say so instead of guessing.
        raise HashSchemeError(
            f"token ids must be in 0..{_U32_MAX} for SGLang page hashes"
        ) from None
    step = 4 * page_size
    for start in range(0, len(data), step):
        prev = hashlib.sha256(prev + data[start : start + step]).digest()
        out.append(prev)
    return out


def sglang_keys(digests: Sequence[bytes]) -> list[bytes]:
    """Directory keys of SGLang's published int64 hashes: the first 8 digest bytes."""
    return [d[:8] for d in digests]
