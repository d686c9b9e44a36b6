"""The simulated GPU: prefill, decode and KV-transfer seconds for one node.

Prefill and transfer come from `kvdir.routing.cost.CostModel` (the H200
figures of ../shared/MISSION.md, docs/routing.md). Decode is not measured in
MISSION.md; it is modelled as memory-bound continuous batching on an H200
(4.8 TB/s HBM, the public spec): one decode step reads the weights once for
the whole batch plus each sequence's KV, so a request's share of the GPU per
output token is `weights / hbm / batch + context * kv_bytes_per_token / hbm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvdir.routing.cost import LLAMA3_8B, LLAMA_70B, SHAPES, CostModel, ModelShape

H200_HBM_BYTES_PER_S = 4.8e12
DECODE_BATCH_DEFAULT = 32

WEIGHTS_BYTES: Mapping[str, float] = MappingProxyType(
    {
        LLAMA3_8B.name: 8.03e9 * 2,  # 8.03 B parameters, bf16
        LLAMA_70B.name: 70.6e9 * 2,  # 70.6 B parameters, bf16
    }
)


class ModelError(ValueError):
    pass


def shape_named(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ModelError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})") from None


@dataclass(frozen=True, slots=True)
class GpuModel:
    cost: CostModel
    """block_tokens is the trace's (512); links are the MISSION figures."""
    weights_bytes: float
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S
    decode_batch: int = DECODE_BATCH_DEFAULT
    _per_token_weights_s: float = field(init=False)

    def __post_init__(self) -> None:
        if self.weights_bytes <= 0 or self.hbm_bytes_per_s <= 0 or self.decode_batch <= 0:
            raise ModelError(f"bad GPU model {self}")
        share = self.weights_bytes / self.hbm_bytes_per_s / self.decode_batch
        object.__setattr__(self, "_per_token_weights_s", share)

    @classmethod
    def of(cls, shape_name: str, block_tokens: int, decode_batch: int) -> GpuModel:
        shape = shape_named(shape_name)
        return cls(
            CostModel(block_tokens=block_tokens, shape=shape),
            WEIGHTS_BYTES[shape.name],
            decode_batch=decode_batch,
        )

    @property
    def block_tokens(self) -> int:
        return self.cost.block_tokens

    def cached_tokens(self, hit_blocks: int, input_tokens: int) -> int:
        """Tokens served from cache; the last prompt token is always computed (logits)."""
        return max(0, min(hit_blocks * self.block_tokens, input_tokens - 1))

    def prefill_s(self, cached_tokens: int, input_tokens: int) -> float:
        return self.cost.prefill.recompute_s(cached_tokens, max(cached_tokens, input_tokens))

    def decode_s(self, context_tokens: int, output_tokens: int) -> float:
        """GPU seconds this request's decode takes from its node (its share of the batches)."""
        kv_per_token = self.cost.shape.kv_bytes_per_token / self.hbm_bytes_per_s
        avg_context = context_tokens + output_tokens / 2
        return output_tokens * (self._per_token_weights_s + avg_context * kv_per_token)

    def transfer_s(self, link: str, blocks: int) -> float:
        return self.cost.transfer_s(link, blocks)

    def per_128mb_s(self, link: str | None) -> float:
        """Seconds to get 128 MB of KV onto a GPU: over `link`, or by recomputing (None)."""
        nbytes = 128 * 10**6
        if link is None:
            tokens = round(nbytes / self.cost.shape.kv_bytes_per_token)
            return self.cost.prefill.seconds(tokens)
        return self.cost.links[link].transfer_s(nbytes)
