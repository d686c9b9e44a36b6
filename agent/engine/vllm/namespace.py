"""The kvdir namespace of one vLLM engine's KV blocks.

Two engines may exchange a block only if its bytes mean the same thing to
both: same model, KV dtype, block size, KV layout (attention backend family,
layer count and per-layer block shape) and tensor-parallel shard. All of that
is in the namespace, so a mismatch is a different namespace: a miss, never
foreign bytes. What a block *holds* (tokens, LoRA adapter, multimodal inputs,
cache_salt) is in vLLM's own block hash, which is the key inside the namespace.

A slot holds one block of every layer, layer after layer; each layer's part is
the block's [H, N, C] view of vLLM's per-layer KV cache (the logical
``[B, H, N, C]`` view vLLM hands connectors) in row-major order, whatever the
physical layout of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from kvdir.v1 import directory_pb2 as pb

DTYPE_NAMES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.uint8": "u8",
}
LAYOUT_PREFIX = "vllm"


class NamespaceError(ValueError):
    """The engine's KV caches are not something the connector can move (the message says why)."""


@dataclass(frozen=True, slots=True)
class KvShape:
    """The KV bytes of one block: `layers` x `block_shape` elements of `dtype`."""

    layers: int
    block_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    device: str
    """The attention backend family ("cpu", "cuda"): it decides what the bytes mean."""
    order: str = "bhnc"
    """The physical order of a block's bytes: "bhnc" (the CPU backend's [H, N, C]
    view, row-major) or a CUDA cache's own, e.g. "bknhc" (transfer/kv_layout.py:
    keys then values of each layer, each [N, H, C])."""

    @property
    def layer_block_bytes(self) -> int:
        return prod(self.block_shape) * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_block_bytes

    @property
    def layout(self) -> str:
        dims = "x".join(map(str, self.block_shape))
        return f"{LAYOUT_PREFIX}-{self.device}-{self.order}/L{self.layers}/{dims}"


def dtype_name(torch_dtype: object) -> str:
    name = DTYPE_NAMES.get(str(torch_dtype))
    if name is None:
        raise NamespaceError(f"kvdir connector: KV cache dtype {torch_dtype} is not supported")
    return name


def namespace(
    model: str, block_tokens: int, shape: KvShape, tp_rank: int, tp_size: int
) -> pb.Namespace:
    if not model or block_tokens <= 0:
        raise NamespaceError("kvdir connector: a namespace needs a model and block_tokens > 0")
    return pb.Namespace(
        model=model,
        dtype=shape.dtype,
        block_tokens=block_tokens,
        layout=shape.layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def describe(ns: pb.Namespace, slot_bytes: int) -> str:
    """The agent [[pools]] entry that serves `ns` (for the error that says to add one)."""
    return (
        f'[[pools]] model = "{ns.model}", dtype = "{ns.dtype}", '
        f'block_tokens = {ns.block_tokens}, layout = "{ns.layout}", '
        f"tp_rank = {ns.tp_rank}, tp_size = {ns.tp_size}, slot_bytes = {slot_bytes}"
    )
