"""Keys and waits of the vLLM tier: the directory seen from the test's side."""

from __future__ import annotations

import random

from kvdir.core.client import namespace
from kvdir.core.hashing import vllm_block_digests, vllm_hash_fn, vllm_none_hash
from kvdir.local import ClusterError, LocalCluster, wait_for
from tests.vllm.model import BLOCK_TOKENS, LAYOUT, MODEL_NAME, VOCAB

NS = namespace(MODEL_NAME, BLOCK_TOKENS, "bf16", LAYOUT, 0, 1)
WAIT_S = 60.0


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB - 10) for _ in range(n)]


def keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM's sha256 block hashes of `tokens` (no LoRA): the connector's keys. A
    cache_salt is an extra key of the first block only (vLLM's kv_cache_utils)."""
    if not salt:
        return vllm_block_digests(tokens, BLOCK_TOKENS, "sha256")
    first = tuple(tokens[:BLOCK_TOKENS])
    h0 = vllm_hash_fn("sha256")((vllm_none_hash("sha256"), first, (("cache_salt", salt),)))
    return [h0, *vllm_block_digests(tokens[BLOCK_TOKENS:], BLOCK_TOKENS, "sha256", parent=h0)]


def held(cluster: LocalCluster, tokens: list[int], salt: str | None = None) -> dict[str, int]:
    """Holder -> prefix blocks of `tokens`, as the directory answers now."""
    with cluster.client(timeout_s=5) as c:
        resp = c.lookup(NS, keys(tokens, salt))
    return {m.node_id: m.prefix_blocks for m in resp.matches}


def wait_held(
    cluster: LocalCluster, tokens: list[int], node: str, blocks: int, salt: str | None = None
) -> None:
    """Wait until the directory says `node` holds at least `blocks` leading blocks."""
    seen: list[dict[str, int]] = [{}]

    def enough() -> bool:
        seen[0] = held(cluster, tokens, salt)
        return seen[0].get(node, 0) >= blocks

    try:
        wait_for(enough, WAIT_S, f"{node} to hold {blocks} blocks", 0.05)
    except ClusterError as e:
        raise ClusterError(f"{e} (the directory said {seen[0]})") from None


def metric(metrics: dict[str, float], name: str) -> float:
    """The sum of a metric over its label sets (the engine driver's `metrics` keys)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
