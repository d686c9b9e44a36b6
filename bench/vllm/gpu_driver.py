"""The GPU bench's engine driver: bench/vllm/driver.py's protocol plus one op.

    python -m bench.vllm.gpu_driver CONFIG_JSON

    {"op": "reset_prefix_cache"}  -> {"reset": true|false}

`LLM.reset_prefix_cache()` drops vLLM's GPU prefix cache and nothing else (its
connector's store is left alone: reset_connector stays False), so the next turn
must come from a connector's tier (kvdir's own pool, vLLM's CPU offload) or be
recomputed. vLLM refuses (False) while a request still holds blocks; the bench
asks again until it is done.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from bench.vllm.driver import _kvdir_series
from tests.vllm.engine_driver import _engine, _generate, _metrics


def _answer(llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op == "generate":
        return _generate(llm, req, "")
    if op == "metrics":
        return {"metrics": {**_metrics(llm), **_kvdir_series()}}
    if op == "reset_prefix_cache":
        return {"reset": bool(llm.reset_prefix_cache())}
    return {"error": f"unknown op {op!r}"}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to stdout: the protocol keeps the original to itself
    llm = _engine(cfg)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            ans = _answer(llm, req)
        except Exception as e:  # report to the bench instead of dying mid-run
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
