"""The model shape `kvdir bench vllm` serves: random weights (load_format="dummy").

Heavier than the test tier's tiny model (tests/vllm/model.py) so that prefill,
not per-request overhead, dominates a 1k-8k token prompt on a CPU engine.
Dummy weights are the same in every engine of one vLLM version, so an engine
that loads a peer's KV answers as if it had computed it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

BLOCK_TOKENS = 32
"""The CPU attention backend wants a multiple of 32."""
VOCAB = 32_000
HEAD_DIM = 64
"""Heads = hidden / 64, KV heads = heads / 4 (GQA as in Llama 3), MLP = 2.75 x hidden."""


@dataclass(frozen=True, slots=True)
class Shape:
    name: str = "kvdir-bench-llama"
    layers: int = 8
    hidden: int = 512

    @property
    def head_dim(self) -> int:
        return HEAD_DIM

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // 4)

    @property
    def intermediate(self) -> int:
        return self.hidden * 11 // 4

    @property
    def block_bytes(self) -> int:
        """One block of every layer on the CPU backend: [H, N, 2 x head_dim] bf16."""
        return self.layers * self.kv_heads * BLOCK_TOKENS * 2 * self.head_dim * 2

    @property
    def layout(self) -> str:
        return f"vllm-cpu-bhnc/L{self.layers}/{self.kv_heads}x{BLOCK_TOKENS}x{2 * self.head_dim}"

    def describe(self) -> str:
        return (
            f"Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads / "
            f"{self.kv_heads} KV heads, MLP {self.intermediate}, bf16, "
            f"{self.block_bytes // BLOCK_TOKENS} B of KV per token"
        )


def write_llama_config(
    path: str,
    dims: dict[str, int],
    max_len: int,
    vocab: int = VOCAB,
    rope_theta: float = 10000.0,
) -> str:
    """A Llama config.json in `path` (random weights: load_format="dummy"). `dims`:
    layers, hidden, heads, kv_heads, head_dim, mlp."""
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["mlp"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims["head_dim"],
        "vocab_size": vocab,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_model(shape: Shape, path: str, max_len: int) -> str:
    dims = {
        "layers": shape.layers,
        "hidden": shape.hidden,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "mlp": shape.intermediate,
    }
    return write_llama_config(path, dims, max_len)


def pool_spec(shape: Shape, slots: int) -> str:
    """The agent --pool spec that serves this shape's connector namespace."""
    return (
        f"model={shape.name},dtype=bf16,block_tokens={BLOCK_TOKENS},layout={shape.layout},"
        f"tp_rank=0,tp_size=1,slot_bytes={shape.block_bytes},slots={slots}"
    )
