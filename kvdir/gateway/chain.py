"""The directory keys of a prompt: the same block hashes its holders publish.

Which scheme depends on who publishes for the backends (docs/events.md,
directory/hashing.py): a stock vLLM engine through the agent's event ingest
(`vllm`: sha256 by default, low 64 bits), SGLang (`sglang`: first 8 bytes of
its SHA-256 page chain), or kvdir's own agents (`kvdir`: xxh3-64). Only full
blocks are keyed, as in the engines' prefix caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdir.core.client import namespace
from kvdir.core.config import ConfigError
from kvdir.core.hashing import (
    HashSchemeError,
    block_chain,
    sglang_keys,
    sglang_page_digests,
    vllm_block_digests,
    vllm_keys,
    vllm_none_hash,
)
from kvdir.gateway.config import ModelConfig
from kvdir.v1 import directory_pb2 as pb


def chain_fn(m: ModelConfig) -> Callable[[Sequence[int]], list[bytes]]:
    """A function from token ids to directory keys for model `m` (checked at load)."""
    bt = m.block_tokens
    if m.hash == "kvdir":
        return lambda tokens: block_chain(tokens, bt)
    if m.hash == "sglang":
        return lambda tokens: sglang_keys(sglang_page_digests(tokens, bt))
    try:
        root = vllm_none_hash(m.hash_algo, m.hash_seed)  # raises for unseeded xxhash
    except HashSchemeError as e:
        raise ConfigError(f"model {m.name!r}: {e}") from e
    ints = not m.hash_bytes

    def vllm(tokens: Sequence[int]) -> list[bytes]:
        return vllm_keys(vllm_block_digests(tokens, bt, m.hash_algo, parent=root), ints)

    return vllm


def model_namespace(m: ModelConfig) -> pb.Namespace:
    return namespace(
        m.namespace_model or m.name, m.block_tokens, m.dtype, m.layout, m.tp_rank, m.tp_size
    )
