"""Pure parts of `kvdir bench vllm` and `kvdir demo --engine vllm`: no engine runs here."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from bench.vllm import _targets, markdown, summarize
from bench.vllm.model import Shape
from kvdir import report
from kvdir.replay.vllm_serve import ChatModel, gateway_toml, prom_value


def _row(tokens: int, recompute_s: float, pull_s: float) -> dict[str, Any]:
    nbytes = tokens * Shape().block_bytes // 32

    def pull(src: str) -> dict[str, Any]:
        return {
            "seconds": pull_s,
            "cached": tokens,
            "tokens": [5],
            "logprobs": [-1.0],
            "load_s": 0.02,
            "loads": 1.0,
            "loaded_bytes": {src: nbytes},
        }

    bare = {
        "transport": "tcp",
        "blocks": tokens // 32,
        "bytes": nbytes,
        "seconds": 0.01,
        "agent_seconds": 0.009,
    }
    return {
        "tokens": tokens,
        "turn_tokens": 64,
        "prefill_saving_s": 1.05,
        "prefill_plain_s": 1.0,
        "bare": {"tcp": bare, "shm": {**bare, "transport": "shm"}},
        "recompute": {"seconds": recompute_s, "tokens": [5], "logprobs": [-1.0]},
        "pull": {"tcp": pull("tcp"), "shm": pull("shm")},
        "check": {t: {"same_tokens": True, "logprob_diff": 0.0} for t in ("tcp", "shm")},
    }


def test_summary_ratios_and_targets() -> None:
    s = summarize(1024, [_row(1024, 2.0, 0.5), _row(1024, 4.0, 0.5)])
    assert s["recompute_s"] == 3.0
    assert s["tcp"]["speedup"] == 6.0
    assert abs(s["save_overhead"] - 0.05) < 1e-9
    assert abs(s["tcp"]["load_vs_bare"] - 0.5) < 1e-9  # 20 ms of load path vs 10 ms bare
    t = {x.key: x.passed for x in _targets([s])}
    assert t == {"load_vs_bare": False, "save_overhead": True, "pull_vs_recompute": True}
    head = report.header(dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    md = markdown(head, Shape().describe(), [s], _targets([s]), "")
    assert "| 1,024 |" in md and "6.0x" in md, md


def test_prom_value_sums_matching_series_only() -> None:
    text = "\n".join(
        [
            "# HELP kvdir:loaded_blocks_total x",
            'kvdir:loaded_blocks_total{engine="0",source="tcp"} 3.0',
            'kvdir:loaded_blocks_total{engine="0",source="shm"} 4.0',
            'kvdir:loaded_blocks_totalx{source="shm"} 100.0',
            "vllm:prompt_tokens_total 7.0",
        ]
    )
    assert prom_value(text, "kvdir:loaded_blocks_total") == 7.0
    assert prom_value(text, "kvdir:loaded_blocks_total", source="shm") == 4.0
    assert prom_value(text, "vllm:prompt_tokens_total") == 7.0
    assert prom_value(text, "nothing") == 0.0


def test_chat_model_vocabulary_is_the_tokenizers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    m = ChatModel()
    d = m.write(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size()
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    assert m.layout == "vllm-cpu-bhnc/L4/2x32x128"
    toml = gateway_toml(8000, ["127.0.0.1:1"], "random", m, d, [], 3)
    assert 'policy = "random"' in toml and "hash_bytes = true" in toml
