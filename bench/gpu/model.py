"""A minimal paged-KV transformer engine for experiments (random weights).

Llama-shaped (RMSNorm, RoPE, grouped-query attention, SwiGLU), bf16, with a
paged KV cache in vLLM's layout: per layer ``[2, blocks, block_size,
kv_heads, head_dim]``. The whole cache is one allocation
``[layers, 2, blocks, block_size, kv_heads, head_dim]`` so that it is one
registered region (one CUDA IPC handle); each layer's view is exactly vLLM's
per-layer tensor.

`Engine.forward(tokens, start, block_table)` runs a prefill of `tokens` at
positions start.. over whatever the cache already holds for positions
0..start-1 (written by an earlier forward or fetched from a peer), writes the
new keys and values into their slots, and returns the last position's logits.
A decode step is the same call with one token.

Not a product component: no batching across requests, no sampling beyond
argmax; just enough to measure time to first token honestly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    full_layers: int
    """Layers of the real model (the experiment may run fewer and scale)."""

    def with_layers(self, layers: int) -> Shape:
        return Shape(
            self.name,
            layers,
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.ffn,
            self.vocab,
            self.full_layers,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # bf16


SHAPES = {
    "8b": Shape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 32),
    "70b": Shape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 80),
    "tiny": Shape("tiny", 2, 128, 4, 2, 32, 256, 512, 2),
}


def _rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return nnf.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_tables(
    max_positions: int, head_dim: int, device: torch.device, theta: float = 500000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin per position, [max_positions, head_dim] (half-split rotation:
    rope(x) = x * cos + swap_halves(x) * sin)."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(0, half, device=device, dtype=torch.float32) / half)
    ang = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)
    sin = torch.cat([-ang.sin(), ang.sin()], dim=-1)
    return cos.to(torch.bfloat16), sin.to(torch.bfloat16)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]. Three kernels."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return torch.addcmul(x * cos, swapped, sin)


class PagedKvCache:
    """[layers, 2, blocks, block_size, kv_heads, head_dim] in one allocation."""

    def __init__(self, shape: Shape, blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.blocks = blocks
        self.block_size = block_size
        self.tensor = torch.zeros(
            (shape.layers, 2, blocks, block_size, shape.kv_heads, shape.head_dim),
            dtype=torch.bfloat16,
            device=device,
        )

    @property
    def segment_bytes(self) -> int:
        """Bytes of one block's keys (or values) of one layer."""
        return self.block_size * self.shape.kv_heads * self.shape.head_dim * 2

    @property
    def block_bytes(self) -> int:
        return 2 * self.shape.layers * self.segment_bytes

    def layer(self, i: int) -> torch.Tensor:
        """vLLM's per-layer view: [2, blocks, block_size, kv_heads, head_dim]."""
        return self.tensor[i]

    def gather_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block-major copy [n, layers, 2, block_size, kv_heads, head_dim] (host staging)."""
        return self.tensor[:, :, blocks].permute(2, 0, 1, 3, 4, 5).contiguous()

    def scatter_blocks(self, blocks: torch.Tensor, staged: torch.Tensor) -> None:
        """Inverse of `gather_blocks`: one indexed write over every layer."""
        self.tensor[:, :, blocks] = staged.permute(1, 2, 0, 3, 4, 5)


class Engine:
    """Random-weight Llama-shaped model over a paged KV cache."""

    def __init__(
        self, shape: Shape, device: torch.device, seed: int = 0, max_positions: int = 32768
    ) -> None:
        self.shape = shape
        self.device = device
        g = torch.Generator(device=device)
        g.manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            # std 1/sqrt(fan_in) keeps activations bounded through many layers
            t = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
            return t.normal_(0.0, 1.0 / math.sqrt(rows), generator=g)

        s = shape
        self.embed = torch.empty((s.vocab, s.hidden), dtype=torch.bfloat16, device=device)
        self.embed.normal_(0.0, 1.0, generator=g)
        self.layers = [
            {
                "qkv": w(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim),
                "o": w(s.heads * s.head_dim, s.hidden),
                "gate_up": w(s.hidden, 2 * s.ffn),
                "down": w(s.ffn, s.hidden),
            }
            for _ in range(s.layers)
        ]
        self.lm_head = w(s.hidden, s.vocab)
        self.cos, self.sin = rope_tables(max_positions, s.head_dim, device)

    def forward(
        self,
        cache: PagedKvCache,
        tokens: torch.Tensor,
        start: int,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """Prefill `tokens` at positions start..start+T-1; returns last logits (fp32).

        block_table[i] is the cache block of positions i*block_size.. and must
        cover start+T positions; positions < start must already be cached.
        """
        with torch.inference_mode():  # a context, not the decorator: typed without torch
            return self._forward(cache, tokens, start, block_table)

    def _forward(
        self,
        cache: PagedKvCache,
        tokens: torch.Tensor,
        start: int,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        s = self.shape
        t = int(tokens.shape[0])
        total = start + t
        bs = cache.block_size
        if block_table.shape[0] * bs < total:
            raise ValueError(f"block table covers {block_table.shape[0] * bs} < {total} positions")
        if total > self.cos.shape[0]:
            raise ValueError(f"{total} positions exceed the RoPE table ({self.cos.shape[0]})")
        # Everything that does not depend on the layer is computed once: this engine
        # is launch-bound for short prefills (tens of microseconds per kernel on the
        # host), so kernels per layer are what TTFT after a fetch costs.
        pos = torch.arange(start, total, device=self.device)
        slots = block_table[pos // bs] * bs + pos % bs
        used = block_table[: -(-total // bs)]
        cos, sin = self.cos[start:total, None, :], self.sin[start:total, None, :]
        lower_right = causal_lower_right(t, total) if start > 0 else None
        nq, nkv, hd = s.heads, s.kv_heads, s.head_dim
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            qkv = _rms_norm(x) @ p["qkv"]
            qk = _rope(qkv[:, : (nq + nkv) * hd].view(t, nq + nkv, hd), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
            v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd)
            layer = cache.layer(i)
            flat = layer.view(2, -1, nkv, hd)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)
            if lower_right is None:
                # Full prefill: flash attention (4-D, causal); heads repeated for GQA
                # so the flash path is certain (GPU-bound here, two copies are noise).
                g = nq // nkv
                a = nnf.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0),
                    v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0),
                    is_causal=True,
                )[0]
            else:
                # Queries are the last t of `total` positions: causal aligned to the
                # bottom right, which flash attention does natively (with GQA), so no
                # mask is built and no head is repeated.
                kv = layer[:, used].view(2, -1, nkv, hd)
                a = nnf.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),
                    kv[0, :total].transpose(0, 1).unsqueeze(0),
                    kv[1, :total].transpose(0, 1).unsqueeze(0),
                    attn_mask=lower_right,
                    enable_gqa=True,
                )[0]
            x = torch.addmm(x, a.transpose(0, 1).reshape(t, nq * hd), p["o"])
            gu = _rms_norm(x) @ p["gate_up"]
            x = torch.addmm(x, nnf.silu(gu[:, : s.ffn]) * gu[:, s.ffn :], p["down"])
        return (_rms_norm(x[-1:]) @ self.lm_head).float()[0]
