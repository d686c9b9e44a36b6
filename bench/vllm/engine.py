"""One bench engine: the test tier's Engine process wrapper, launched with the bench's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.vllm.model import BLOCK_TOKENS
from tests.vllm.engines import Engine, vllm_python

START_TIMEOUT_S = 1500.0
"""Four engines starting at once on a loaded 2-core host took over 8 minutes here."""
KV_CACHE_GIB = 2
"""VLLM_CPU_KVCACHE_SPACE per engine: an 8k prompt of the default shape is 64 MiB."""


@dataclass
class BenchEngine(Engine):
    model_name: str = ""
    max_model_len: int = 0
    start_timeout_s: float = START_TIMEOUT_S

    def driver_config(self) -> dict[str, Any]:
        return {
            "model_dir": self.model_dir,
            "model_name": self.model_name,
            "block_tokens": BLOCK_TOKENS,
            "max_model_len": self.max_model_len,
            "kv_transfer_config": self.kv_transfer_config,
        }

    def driver_env(self) -> dict[str, str]:
        return {**super().driver_env(), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}

    def command(self) -> list[str]:
        return [str(vllm_python()), "-m", "bench.vllm.driver"]
