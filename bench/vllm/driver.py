"""The test tier's engine driver (tests/vllm/engine_driver.py) with histograms in `metrics`.

    python -m bench.vllm.driver CONFIG_JSON

The bench needs the connector's own series (kvdir:loaded_bytes_total by
source, the kvdir:load_seconds histogram), which vLLM's get_metrics() leaves
out (it reads only vllm:* names): here they are read from the front-end
process's Prometheus registry, where vLLM's stat loggers feed the connector's
KvdirPromMetrics. Counters appear as NAME{labels}, histograms as NAME_sum and
NAME_count. Everything else is the test driver's protocol, unchanged.
"""

from __future__ import annotations

import json
import os
import sys

from tests.vllm.engine_driver import _engine, _generate, _metrics


def _kvdir_series() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("kvdir:"):
            continue
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "engine")
            key = f"{s.name}{{{labels}}}" if labels and s.name.endswith("_total") else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
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
                ans = {"metrics": {**_metrics(llm), **_kvdir_series()}}
            else:
                ans = {"error": f"unknown op {op!r}"}
        except Exception as e:  # report to the bench instead of dying mid-run
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
