"""The test tier's engine driver (tests/vllm/engine_driver.py) with histograms in `metrics`.

    python -m bench.vllm.driver CONFIG_JSON

The bench needs the connector's `kvdir:load_seconds` (a histogram), which the
test driver's metrics leave out: here a histogram appears as NAME_sum and
NAME_count. Everything else is the test driver's protocol, unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tests.vllm.engine_driver import _engine, _generate, _metrics


def _histograms(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "sum") and hasattr(m, "count"):
            out[f"{m.name}_sum"] = out.get(f"{m.name}_sum", 0.0) + float(m.sum)
            out[f"{m.name}_count"] = out.get(f"{m.name}_count", 0.0) + float(m.count)
    return out


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to stdout: the protocol keeps the original to itself
    llm = _engine(cfg)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        try:
            if op == "generate":
                ans = _generate(llm, req, "")
            elif op == "metrics":
                ans = {"metrics": {**_metrics(llm), **_histograms(llm)}}
            else:
                ans = {"error": f"unknown op {op!r}"}
        except Exception as e:  # report to the bench instead of dying mid-run
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
