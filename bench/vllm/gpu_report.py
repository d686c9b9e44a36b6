"""The GPU bench's results: one markdown and one JSON for the parts that ran
(bench/vllm/gpu.py), written after each part so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import datetime as dt
import math
from pathlib import Path
from typing import Any

from bench.vllm import gpu_two
from bench.vllm.gpu_pair import PEER_CONNECTOR
from kvdir import report

IPC_VS_FLOOR_MAX = 1.15
LOAD_VS_COPY_MAX = 2.0
HOST_LOAD_VS_BARE_MIN = 0.7
SAVE_OVERHEAD_MAX = 0.03


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def targets_8b(summary: list[dict[str, Any]]) -> list[report.Target]:
    longest = max(summary, key=lambda s: s["tokens"]) if summary else None
    return [
        report.at_most("ipc_vs_floor", f"pulled TTFT over CUDA IPC / local hit at "
                       f"{longest['tokens'] if longest else '-'} tokens",
                       longest["ipc_vs_floor"] if longest else None, IPC_VS_FLOOR_MAX, "x"),
        report.at_most("load_vs_copy", "IPC load / bare device copy (worst)",
                       max((s["ipc_load_vs_copy"] for s in summary), default=None),
                       LOAD_VS_COPY_MAX, "x"),
        report.at_least("host_vs_bare", "host-path load rate / bare fetch rate (worst)",
                        min((s["host_load_vs_bare"] for s in summary), default=None),
                        HOST_LOAD_VS_BARE_MIN, "x"),
        report.at_most("save_overhead", "prefill added by saving (worst)",
                       max((s["save_overhead"] for s in summary), default=None),
                       SAVE_OVERHEAD_MAX, ""),
    ]  # fmt: skip


def markdown_8b(shape: str, summary: list[dict[str, Any]]) -> list[str]:
    ms = _ms
    rows = [
        [s["tokens"], ms(s["recompute_s"]), ms(s["ipc_s"]), ms(s["host_s"]), ms(s["floor_s"]),
         f"{s['ipc_vs_floor']:.2f}", ms(s["ipc_load_s"]), ms(s["bare_copy_s"]),
         ms(s["host_load_s"]), ms(s["bare_fetch_s"]), ms(s["plain_prefill_s"]),
         ms(s["saving_prefill_s"]), f"{100 * s['save_overhead']:+.1f}%", s["cached_min"],
         "yes" if s["correct"] else "NO"]
        for s in summary
    ]  # fmt: skip
    head_cells = [
        "tokens", "recompute ms", "pull CUDA IPC ms", "pull host path ms", "local hit ms",
        "IPC / local hit", "IPC load ms", "bare D2D copy ms", "host load ms",
        "bare agent fetch ms", "plain prefill ms", "saving prefill ms", "save overhead",
        "cached tokens (min)", "same first token",
    ]  # fmt: skip
    return [f"Model: {shape}.", "", "## Turn-2 TTFT (median of repeats)", "",
            report.table(rows, head_cells), "", *_path_table(summary)]  # fmt: skip


def _opt(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or math.isnan(x) else fmt.format(x)


def _path_table(summary: list[dict[str, Any]]) -> list[str]:
    """Where a pulled request's time went, from the engine's own log lines."""
    if not any(s.get("ipc_path") for s in summary):
        return []
    rows = []
    for s in summary:
        p = s.get("ipc_path") or {}
        plain = s.get("floor_plain_s")
        rows.append([
            s["tokens"], _ms(s["ipc_s"]), _ms(s["floor_s"]),
            _opt(1000 * plain if plain is not None else None), _ms(s["ipc_s"] - s["floor_s"]),
            _opt(p.get("lookup_ms"), "{:.2f}"), _opt(p.get("thread_ms"), "{:.2f}"),
            _opt(p.get("agent_call_ms"), "{:.2f}"), _opt(p.get("taken_ms"), "{:.2f}"),
            _opt(p.get("calls"), "{:.0f}"),
            _opt(p.get("load_ms"), "{:.2f}"), _opt(p.get("reported_ms"), "{:.2f}"),
            _opt(p.get("forward_ms"), "{:.2f}"), _opt(p.get("steps"), "{:.0f}"),
        ])  # fmt: skip
    head = [
        "tokens", "pull CUDA IPC ms", "local hit ms", "local hit, no connector ms",
        "pull - local hit ms", "lookup ms", "lookup: its thread started ms",
        "lookup: agent call ms", "lookup: answer taken ms", "scheduler calls", "load ms",
        "allocation -> load reported ms", "allocation -> forward pass ms", "steps",
    ]  # fmt: skip
    return [
        "## Where a pull over CUDA IPC spends its time (median of repeats)", "",
        "From engine b's own log lines: the scheduler side's timeline (vLLM's first "
        "question about the request, its lookup settling, the blocks' allocation, the "
        "load's end reported back, the first forward pass; each step counted) and the "
        "worker's load line. The lookup's parts: from vLLM's first question to the "
        "lookup thread's start, the agent call, and from the agent's answer to the "
        "scheduler thread taking it. The local hit without a connector is engine n's "
        "second identical request.", "",
        report.table(rows, head), "",
    ]  # fmt: skip


def markdown(
    head: dict[str, Any],
    sections: list[str],
    checks: list[dict[str, Any]],
    targets: list[report.Target],
    note: str,
) -> str:
    check_rows = [[c["check"], "ok" if c["ok"] else "FAILED",
                   {k: v for k, v in c.items() if k not in ("check", "ok", "trace")}]
                  for c in checks]  # fmt: skip
    return "\n".join([
        "# kvdir bench vllm --device cuda", "", report.header_markdown(head), "",
        note, "", *sections, "## Checks", "",
        report.table(check_rows, ["check", "result", "seen"]), "", "## Targets", "",
        report.targets_table(targets), "",
    ])  # fmt: skip


def _timing(parts: tuple[str, ...], four: dict[str, Any], two: dict[str, Any] | None) -> str:
    got = {"8b": four.get("seconds")} if "8b" in parts else {}
    got.update(two["part_s"] if two is not None else {})
    return "Seconds per part (engine starts included): " + ", ".join(
        f"{k} {v:.0f}" for k, v in got.items() if v is not None
    )


def targets_two(out: dict[str, Any]) -> list[report.Target]:
    """The CUDA IPC targets, held against the 70B shape too; the peer's
    reload next to kvdir's as information (no goal: different tiers)."""
    s70 = out.get("summary_70b")
    got: list[report.Target] = []
    if s70 is not None:
        got += [
            report.at_most("ipc_vs_floor_70b", "70B shape: pulled TTFT over CUDA IPC / local "
                           "hit at 8192 tokens", s70["ipc_vs_floor"], IPC_VS_FLOOR_MAX, "x"),
            report.at_most("load_vs_copy_70b", "70B shape: IPC load / bare device copy",
                           s70["ipc_load_vs_copy"], LOAD_VS_COPY_MAX, "x"),
        ]  # fmt: skip
    peers = out["peer_summary"]
    if "a" in peers and "o" in peers:
        ratio = peers["a"]["reload_s"] / peers["o"]["reload_s"]
        got.append(
            report.Target(
                "reload_vs_peer", f"kvdir reload TTFT / {PEER_CONNECTOR}'s (70B shape)",
                "info", ratio, "x", None,
            )
        )  # fmt: skip
    return got


def write_results(
    args: argparse.Namespace, parts: tuple[str, ...], started: dt.datetime,
    head: dict[str, Any], four: dict[str, Any], two: dict[str, Any] | None, final: bool,
) -> None:  # fmt: skip
    """Write (or rewrite) the run's results; `final`: every selected part has run."""
    summary = four["summary"]
    targets = targets_8b(summary) if "8b" in parts else []
    targets += targets_two(two) if two is not None else []
    head = {**head, "wall_s": (dt.datetime.now(dt.UTC) - started).total_seconds()}
    sections = markdown_8b(four["shape"], summary) if "8b" in parts else []
    if "error" in four:
        sections += [f"8B part failed: `{four['error']}`", ""]
    sections += gpu_two.markdown(two) if two is not None else []
    sections += [_timing(parts, four, two), ""]
    if not final:
        sections += ["**Partial: written after the 8B part; the run went on.**", ""]
    checks = four["checks"] + (two["checks"] if two is not None else [])
    md = markdown(head, sections, checks, targets, args.note)
    data = {**head, "parts": list(parts), "shape": four.get("shape"), "summary": summary,
            "raw": four["raw"], "checks": four["checks"],
            "targets": [t.as_dict() for t in targets], "two_engine": two}  # fmt: skip
    md_path, js_path = report.write(Path(args.out), f"vllm-gpu-{started:%Y-%m-%d}", md, data)
    if final:
        print(md)
    print(f"wrote {md_path} and {js_path}", flush=True)
