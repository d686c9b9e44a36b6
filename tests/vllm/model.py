"""The tiny Llama-shaped model the vLLM tier serves (random weights: load_format="dummy").

Dummy weights are the same in every process of one vLLM version, so two
engines on two nodes compute the same KV for the same tokens: what lets a
test compare a loaded prefix with a recomputed one.
"""

from __future__ import annotations

import json
import os

LAYERS = 4
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
VOCAB = 32_000
BLOCK_TOKENS = 32
MAX_MODEL_LEN = 4096
MODEL_NAME = "kvdir-tiny-llama"

# The KV bytes of one block on the CPU backend: [H, N, 2 x head_dim] bf16 per layer.
BLOCK_SHAPE = (KV_HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK_TOKENS * 2 * HEAD_DIM * 2
LAYOUT = f"vllm-cpu-bhnc/L{LAYERS}/" + "x".join(map(str, BLOCK_SHAPE))


def write_model(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def pool_spec(slots: int, tp_size: int = 1) -> str:
    """The agent --pool spec that serves this model's connector namespace."""
    return (
        f"model={MODEL_NAME},dtype=bf16,block_tokens={BLOCK_TOKENS},layout={LAYOUT},"
        f"tp_rank=0,tp_size={tp_size},slot_bytes={BLOCK_BYTES},slots={slots}"
    )
