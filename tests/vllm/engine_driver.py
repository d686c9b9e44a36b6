"""A real vLLM engine behind a line protocol, run with the vLLM venv's Python.

    python -m tests.vllm.engine_driver CONFIG_JSON

stdin: one JSON request per line; stdout: one JSON answer per line, after a
first {"ready": ...} line. Requests:

    {"op": "generate", "prompts": [[ids...]], "max_tokens": 8,
     "cache_salt": null, "lora": null, "logprobs": false, "prompt_logprobs": false}

(vLLM reads no cached prefix for a request that asks for prompt logprobs, so
tests of loaded prefixes compare the sampled tokens' logprobs.)
    {"op": "metrics"}       vLLM's in-process metrics (counters and gauges by name),
                            and the connector's kvdir:*_total counters
    {"op": "quit"}

The engine keeps running between requests, so one start (~20 s here) serves
a whole test module.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine(cfg: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": cfg["model_dir"],
        "served_model_name": cfg["model_name"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": cfg["block_tokens"],
        "gpu_memory_utilization": 0.3,
        "max_model_len": cfg["max_model_len"],
        "max_num_seqs": 8,
        "dtype": "bfloat16",
        "disable_log_stats": False,
        "seed": 0,
    }
    kwargs.update(cfg.get("llm_kwargs") or {})  # e.g. a GPU engine's memory share
    if cfg.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = cfg["kv_transfer_config"]
    if cfg.get("lora_dir"):
        kwargs.update(enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLM(**kwargs)


def _generate(llm: Any, req: dict[str, Any], lora_dir: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    sp = SamplingParams(
        max_tokens=req.get("max_tokens", 8),
        temperature=0.0,
        detokenize=False,
        prompt_logprobs=0 if req.get("prompt_logprobs") else None,
        logprobs=0 if req.get("logprobs") else None,
    )
    prompts = []
    for ids in req["prompts"]:
        p = TokensPrompt(prompt_token_ids=ids)
        if req.get("cache_salt"):
            p["cache_salt"] = req["cache_salt"]
        prompts.append(p)
    lora = None
    if req.get("lora"):
        name, lid = req["lora"]
        lora = LoRARequest(name, lid, os.path.join(lora_dir, name))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora)
    seconds = time.perf_counter() - t0
    answers = []
    for o in outs:
        lps = None
        if o.prompt_logprobs is not None:
            lps = [None if d is None else next(iter(d.values())).logprob for d in o.prompt_logprobs]
        sampled = o.outputs[0].logprobs
        answers.append(
            {
                "logprobs": None
                if sampled is None
                else [d[t].logprob for d, t in zip(sampled, o.outputs[0].token_ids, strict=True)],
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens,
                "prompt_logprobs": lps,
            }
        )
    return {"outputs": answers, "seconds": seconds}


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            key = m.name
            labels = getattr(m, "labels", {}) or {}
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "engine")
            if extra:
                key = f"{key}{{{extra}}}"
            out[key] = out.get(key, 0.0) + float(value)
    out.update(_kvdir_counters())
    return out


def _kvdir_counters() -> dict[str, float]:
    """The connector's counters (stats.py): vLLM's metrics reader keeps only vllm:*."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("kvdir:"):
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "engine")
            key = f"{s.name}{{{extra}}}" if extra else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def main() -> int:
    cfg = json.loads(sys.argv[1])
    # vLLM logs to stdout: the protocol keeps the original stdout to itself.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llm = _engine(cfg)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        try:
            if op == "generate":
                ans = _generate(llm, req, cfg.get("lora_dir", ""))
            elif op == "metrics":
                ans = {"metrics": _metrics(llm)}
            else:
                ans = {"error": f"unknown op {op!r}"}
        except Exception as e:  # report to the test instead of dying mid-module
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
