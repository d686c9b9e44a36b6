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

from collections.abc import Sequence
from dataclasses import dataclass

from kvdir.agent.events.decode import BlockStored, DecodeError, Hash
from kvdir.agent.events.hashes import keys
from kvdir.core.hashing import (
    VLLM_ALGOS,
    VLLM_DEFAULT_SEED,
    HashSchemeError,
    vllm_block_digests,
    vllm_hash_fn,
    vllm_keys,
    vllm_none_hash,
)

# The pure hashing lives in directory/hashing.py (the gateway computes the same
# keys from prompts); these names keep the agent's and the CLI's callers unchanged.
DEFAULT_SEED = VLLM_DEFAULT_SEED
ALGOS = VLLM_ALGOS
SelfCheckError = HashSchemeError
hash_fn = vllm_hash_fn
none_hash = vllm_none_hash
block_digests = vllm_block_digests
published_keys = vllm_keys


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
