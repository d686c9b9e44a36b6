"""PEFT-style LoRA adapters for the tiny test model, written by the test itself.

An adapter is a directory with `adapter_config.json` and
`adapter_model.safetensors`. The safetensors file is written here by hand (an
8-byte header length, a JSON header, raw little-endian float32 data), so the
test's own venv needs no safetensors package. The B matrices are not zero,
so two adapters really compute different KV for the same tokens.
"""

from __future__ import annotations

import json
import os
import random
import struct

from tests.vllm.model import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS

LORA_RANK = 8
"""Must not exceed the engine's max_lora_rank (engine_driver.py: 8)."""
LORA_ALPHA = 16
LORA_SCALE = 1.0
"""Std-dev of the random weights: the adapter must dominate the tiny dummy base weights
(+-1e-3) for two adapters to pick different greedy tokens; bf16 stays finite."""
TARGETS = {
    "q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN),
}
"""Target module -> (input, output) width. v_proj changes the KV itself; o_proj
writes to the residual stream, so the adapter changes the greedy tokens too
(the dummy base weights are tiny)."""


def _tensors(seed: int) -> dict[str, tuple[list[int], list[float]]]:
    rng = random.Random(seed)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(LAYERS):
        for module, (width_in, width_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (
                ("lora_A", [LORA_RANK, width_in]),
                ("lora_B", [width_out, LORA_RANK]),
            ):
                n = shape[0] * shape[1]
                out[f"{prefix}.{part}.weight"] = (
                    shape,
                    [rng.gauss(0, LORA_SCALE) for _ in range(n)],
                )
    return out


def _write_safetensors(path: str, tensors: dict[str, tuple[list[int], list[float]]]) -> None:
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def write_adapter(lora_dir: str, name: str, seed: int) -> str:
    """Write adapter `name` under `lora_dir` (the engine driver looks there by name)."""
    path = os.path.join(lora_dir, name)
    os.makedirs(path, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(TARGETS),
        "base_model_name_or_path": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    _write_safetensors(os.path.join(path, "adapter_model.safetensors"), _tensors(seed))
    return path
