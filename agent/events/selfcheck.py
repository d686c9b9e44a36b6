"""The hash self-test: recompute the hashes vLLM publishes and compare.

A hash, seed or block-size mismatch between the engine and whoever computes
lookup chains gives a silent 0% hit rate. vLLM's scheme (v1 prefix caching)::

    NONE_HASH = H(seed)                 seed: PYTHONHASHSEED if set, else
                                        "vllm-none-hash" (sha256 variants)
    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))

over full blocks only; H is sha256 (pickle, protocol 5), sha256_cbor (canonical
CBOR), xxhash or xxhash_cbor (xxh3-128). Events carry the low 64 bits as an
unsigned int (the default) or the whole digest as bytes. xxhash variants
without PYTHONHASHSEED use a random per-process seed: nothing outside the
engine can predict those hashes, and the self-test says so.

A BlockStored event is checkable when its first block starts a prefix
(parent nil) or its parent came as a whole digest, and no block carries extra
keys (LoRA, multimodal, cache_salt): then its token_ids determine its hashes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

from agent.events.decode import BlockStored, DecodeError, Hash
from agent.events.hashes import keys

DEFAULT_SEED = "vllm-none-hash"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class SelfCheckError(ValueError):
    pass


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return _FNS[algo]
    except KeyError:
        raise SelfCheckError(f"unknown hash algorithm {algo!r} (one of {ALGOS})") from None


def none_hash(algo: str, seed: str = "") -> bytes:
    """vLLM's NONE_HASH: the parent of every prefix's first block."""
    if not seed and algo.startswith("xxhash"):
        raise SelfCheckError(
            f"{algo} without PYTHONHASHSEED uses a random per-process seed: its hashes "
            "cannot be recomputed; set PYTHONHASHSEED on the engine and give it as the seed"
        )
    return hash_fn(algo)(seed or DEFAULT_SEED)


def block_digests(
    tokens: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    seed: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """The digests of each full block of `tokens` (no extra keys)."""
    if block_size <= 0:
        raise SelfCheckError("block_size must be > 0")
    fn = hash_fn(algo)
    prev = parent if parent is not None else none_hash(algo, seed)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = fn((prev, tuple(tokens[start : start + block_size]), None))
        out.append(prev)
    return out


def published_keys(digests: Sequence[bytes], int_hashes: bool) -> list[bytes]:
    """Directory keys of the hashes vLLM publishes for these digests."""
    return [d[-8:] for d in digests] if int_hashes else list(digests)


@dataclass(frozen=True, slots=True)
class CheckResult:
    ok: bool
    blocks: int
    message: str
    expected: tuple[bytes, ...] = ()
    published: tuple[bytes, ...] = ()


def checkable(ev: BlockStored) -> bool:
    if ev.parent is not None and type(ev.parent) is not bytes:
        return False  # an int parent is only the low 64 bits: the chain can't continue
    if ev.extra_keys and any(k is not None for k in ev.extra_keys):
        return False
    return bool(ev.hashes) and len(ev.token_ids) >= ev.block_size * len(ev.hashes)


def _expected(ev: BlockStored, algo: str, seed: str, block_size: int) -> list[bytes]:
    parent = ev.parent if type(ev.parent) is bytes else None
    n = len(ev.hashes)
    digests = block_digests(ev.token_ids[: n * block_size], block_size, algo, seed, parent)
    return published_keys(digests, int_hashes=type(ev.hashes[0]) is int)


def check_event(ev: BlockStored, algo: str, seed: str, block_size: int) -> CheckResult | None:
    """Compare a published BlockStored with our recomputation (None: not checkable)."""
    if not checkable(ev):
        return None
    try:
        got = keys(ev.hashes)
    except DecodeError as e:
        return CheckResult(False, len(ev.hashes), f"the engine's hashes are malformed: {e}")
    if ev.block_size != block_size:
        return CheckResult(
            False,
            len(got),
            f"block size mismatch: the engine uses {ev.block_size}, "
            f"the agent is configured with {block_size}",
        )
    want = _expected(ev, algo, seed, block_size)
    if want == got:
        return CheckResult(True, len(got), f"{len(got)} block hashes match ({algo})")
    hint = diagnose(ev, got)
    return CheckResult(
        False,
        len(got),
        f"HASH MISMATCH: the engine's hashes are not {algo} with seed "
        f"{seed or DEFAULT_SEED!r}; lookups from tokens will never hit. {hint}",
        tuple(want),
        tuple(got),
    )


def diagnose(ev: BlockStored, got: list[bytes], seeds: Sequence[str] = ("",)) -> str:
    """Which algorithm / seed reproduces the engine's hashes, if any we know."""
    for algo in ALGOS:
        for seed in seeds:
            try:
                if _expected(ev, algo, seed, ev.block_size) == got:
                    return f"They match {algo} with seed {seed or DEFAULT_SEED!r}."
            except SelfCheckError:
                continue
    return "No known algorithm with the default seed reproduces them (PYTHONHASHSEED?)."


def first_block_hashes(
    tokens: Sequence[int], block_size: int, algo: str, seed: str, int_hashes: bool = True
) -> list[Hash]:
    """The hashes as vLLM would put them in a BlockStored event."""
    digests = block_digests(tokens, block_size, algo, seed)
    if int_hashes:
        return [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in digests]
    return list(digests)
