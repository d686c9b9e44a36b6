"""One bench engine: the test tier's Engine process wrapper, launched with the bench's shape."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

from bench.vllm.model import BLOCK_TOKENS
from tests.vllm.engines import REPO, Engine, EngineError, vllm_python

START_TIMEOUT_S = 1500.0
"""Four engines starting at once on a loaded 2-core host took over 8 minutes here."""
KV_CACHE_GIB = 2
"""VLLM_CPU_KVCACHE_SPACE per engine: an 8k prompt of the default shape is 64 MiB."""


@dataclass
class BenchEngine(Engine):
    model_name: str = ""
    max_model_len: int = 0

    def wait_ready(self) -> None:
        ready = self._read(START_TIMEOUT_S)
        if not ready.get("ready"):
            raise EngineError(f"engine {self.name} did not start: {ready}")
        self.ready = True

    def launch(self) -> None:
        cfg = {
            "model_dir": self.model_dir,
            "model_name": self.model_name,
            "block_tokens": BLOCK_TOKENS,
            "max_model_len": self.max_model_len,
            "kv_transfer_config": self.kv_transfer_config,
        }
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(REPO),
            VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_LOGGING_LEVEL="INFO",
            **self.env,
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(vllm_python()), "-m", "bench.vllm.driver", json.dumps(cfg)],
                cwd=str(REPO),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
