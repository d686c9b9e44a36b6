"""Table, target check and plot of a GPU experiment result (bench/gpu/experiment.py).

python -m bench.gpu.report bench/results/gpu-<date>.json   # rewrites .md and .png
"""

from __future__ import annotations

import json
import sys
from typing import Any

READ_VS_BARE_MAX = 1.2
TTFT_SHARE_MAX = 0.10


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}" if s >= 0.01 else f"{s * 1e3:.2f}"


def _logits(r: dict[str, Any]) -> str:
    parts = []
    for mode in ("tcp", "cuda"):
        m = r[mode]
        rel = m["logits_max_abs_diff"] / max(m["logits_ref_max_abs"], 1e-9)
        parts.append(
            f"{mode}: vs chunked {'bitwise equal' if m.get('logits_equal_chunked') else 'DIFFER'}"
            f"; vs single pass max|d| {m['logits_max_abs_diff']:.3g} ({rel:.1%} of max), "
            f"cos {m['logits_cosine']:.5f}, top-5 overlap {m.get('top5_overlap', '?')}/5, "
            f"argmax {'=' if m['argmax_equal'] else '!='}"
        )
    return "; ".join(parts)


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| shape (layers run) | context | KV MB | A: recompute TTFT ms | B: tcp TTFT ms (fetch) "
        "| C: cuda TTFT ms (fetch) | C read ms (kernel) | segment-list read ms | bare copy ms "
        "| read / bare (kernel / bare) | C / A TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fo = r["fetch_only"]
        read, bare = fo["read_s"], r["bare_copy"]["ipc_s"]
        out.append(
            f"| {r['shape']} ({r['layers']}/{r['full_layers']}) | {r['context']:,} "
            f"| {r['bytes'] / 1e6:,.0f} | {_ms(r['recompute']['ttft_s'])} "
            f"| {_ms(r['tcp']['ttft_s'])} ({_ms(r['tcp']['fetch_s'])}) "
            f"| {_ms(r['cuda']['ttft_s'])} ({_ms(r['cuda']['fetch_s'])}) "
            f"| {_ms(read)} ({_ms(fo.get('read_kernel_s', read))}) "
            f"| {_ms(fo.get('segments_read_s', read))} | {_ms(bare)} | {read / bare:.2f} "
            f"({fo.get('read_kernel_s', read) / bare:.2f}) "
            f"| {r['cuda']['ttft_s'] / r['recompute']['ttft_s']:.1%} |"
        )
    scaled = [r for r in rows if r["layers"] != r["full_layers"]]
    if scaled:
        out += [
            "",
            "Rows run with fewer layers than the model has, scaled linearly to the full "
            "layer count (every part of TTFT and every byte of KV is per layer; the "
            "embedding and LM head are not, so this slightly overstates them):",
            "",
            "| shape (scaled) | context | KV MB | A: recompute TTFT ms | B: tcp TTFT ms "
            "| C: cuda TTFT ms | C / A TTFT |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in scaled:
            k = r["full_layers"] / r["layers"]
            out.append(
                f"| {r['shape']} (x{k:g} -> {r['full_layers']} layers) | {r['context']:,} "
                f"| {r['bytes'] * k / 1e6:,.0f} | {_ms(r['recompute']['ttft_s'] * k)} "
                f"| {_ms(r['tcp']['ttft_s'] * k)} | {_ms(r['cuda']['ttft_s'] * k)} "
                f"| {r['cuda']['ttft_s'] / r['recompute']['ttft_s']:.1%} |"
            )
    return out


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    ratios = [(r, r["fetch_only"]["read_s"] / r["bare_copy"]["ipc_s"]) for r in rows]
    kernel = max(
        r["fetch_only"].get("read_kernel_s", r["fetch_only"]["read_s"]) / r["bare_copy"]["ipc_s"]
        for r in rows
    )
    met = [f"{r['shape']} {r['context']:,}" for r, x in ratios if x <= READ_VS_BARE_MAX]
    out.append(
        f"- C's read within {READ_VS_BARE_MAX}x of one bare device-to-device copy of the "
        f"same bytes: the kernel alone (CUDA events) is at worst {kernel:.2f}x -> "
        f"{'met' if kernel <= READ_VS_BARE_MAX else 'NOT met'} at every size; the whole "
        f"call (host work, launch, completion wait; wall clock) is within "
        f"{READ_VS_BARE_MAX}x for {', '.join(met) or 'no row'}, worst "
        f"{max(x for _, x in ratios):.2f}x (a fixed ~0.03-0.15 ms of host time that "
        "weighs most on the smaller transfers)"
    )
    for r in rows:
        if r["context"] == 8192:
            share = r["cuda"]["ttft_s"] / r["recompute"]["ttft_s"]
            out.append(
                f"- {r['shape']} ({r['layers']} layers), 8k tokens: C's TTFT is {share:.1%} of "
                f"recompute (target <= {TTFT_SHARE_MAX:.0%}) -> "
                f"{'met' if share <= TTFT_SHARE_MAX else 'NOT met'}"
            )
    fetched = [r[m] for r in rows for m in ("tcp", "cuda")]
    exact = all(f.get("logits_equal_chunked", False) for f in fetched)
    kv_exact = all(f.get("kv_equal_chunked", False) for f in fetched)
    cos = min(f["logits_cosine"] for f in fetched)
    argmax = sum(f["argmax_equal"] for f in fetched)
    bitwise = all(r["cuda"].get("kv_bitwise_equal_to_previous_mode", False) for r in rows)
    inval = all(r["invalidation"]["passed"] for r in rows)
    full = all(f["valid_blocks"] == r["blocks"] for r in rows for f in (r["tcp"], r["cuda"]))
    out.append(
        f"- logits match: with fetched KV (tcp and cuda) B's next-token logits are bitwise "
        f"equal to those after B prefills the same prefix itself and then the rest: {exact}; "
        f"the fetched KV is bitwise B's own: {kv_exact}. Against a single-pass recompute of "
        f"the whole sequence (other GEMM shapes, so bf16 rounding differs) the worst cosine "
        f"is {cos:.5f}, and the argmax agrees in {argmax} of {len(fetched)} runs -> "
        f"{'met' if exact and cos >= 0.999 else 'NOT met'}"
    )
    out.append(
        f"- every block validated after the copy: {full}; KV from tcp and cuda bitwise "
        f"equal: {bitwise}; eviction detected (the fetch stopped at the evicted block): {inval}"
    )
    if rows[0]["gpu_a"] != rows[0]["gpu_b"]:
        for r in rows:
            if r["context"] == 4096:
                share = r["bare_copy"]["ipc_s"] / r["fetch_only"]["read_s"]
                out.append(
                    f"- {r['shape']}, 4k tokens across GPUs: kvdir's read moves "
                    f"{share:.2f}x the bandwidth of a raw peer copy of the same bytes "
                    f"({r['bytes'] / r['fetch_only']['read_s'] / 1e9:.0f} vs "
                    f"{r['bytes'] / r['bare_copy']['ipc_s'] / 1e9:.0f} GB/s; target >= 0.8) "
                    f"-> {'met' if share >= 0.8 else 'NOT met'}"
                )
    out.append("")
    out.append(
        "Logits per row (fetched KV vs B's own chunked prefill, and vs a single-pass "
        "recompute; bf16 model, fp32 logits):"
    )
    out.append("")
    for r in rows:
        out.append(f"- {r['shape']} {r['context']:,}: {_logits(r)}")
    return out


def write_report(doc: dict[str, Any], base: str) -> None:
    rows = doc["rows"]
    r0 = rows[0]
    same_gpu = r0["gpu_a"] == r0["gpu_b"]
    lines = [
        f"# GPU KV: prefill versus fetch ({doc['date']})",
        "",
        f"Machine: {r0['gpu']} (node A on GPU {r0['gpu_a']}, node B on GPU {r0['gpu_b']}"
        f"{', the same GPU: CUDA IPC between two processes' if same_gpu else ', peer access'})"
        f", host {doc['host']}, torch {r0['torch']}, Python {doc['python']}; "
        f"host pools page-locked: {r0['pinned']}.",
        f"Command: `{doc['command']}` ({doc['seconds']:.0f} s).",
        "",
        f"TTFT of turn 2 on node B (context + {r0['new_tokens']} new tokens), median of "
        f"{len(r0['recompute']['ttft_all_s'])} runs after a warm-up; fetch = the transfer and "
        "header validation part of it. 'C read' is the cuda read alone, wall time from the "
        "call to the bytes landed (the kernel alone, CUDA events around it, in brackets): "
        "one kernel "
        "over every scattered 2 x layers x blocks segment, addresses computed on the GPU "
        "from the block ids (`read_blocks`); 'segment-list read' the same bytes through the "
        "generic `read_batch` (a table of 24 bytes per segment built and uploaded by the "
        "host); 'bare copy' one cudaMemcpy of the same bytes from the holder's region "
        "(contiguous). Both nodes' blocks are scattered (shuffled free lists).",
        "",
        *table(rows),
        "",
        "Targets:",
        "",
        *targets(rows),
        "",
        "Other figures per row (JSON): holder prefill and host offload time, cold (first) "
        "read including the IPC handle open, segment counts, every run's TTFT.",
        "",
    ]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    plot(rows, base + ".png")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    shapes = list(dict.fromkeys((r["shape"], r["layers"]) for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    modes = [("recompute", "A: recompute"), ("tcp", "B: TCP via host"), ("cuda", "C: CUDA IPC")]
    for ax, (shape, layers) in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if (r["shape"], r["layers"]) == (shape, layers)]
        w = 0.27
        for j, (m, label) in enumerate(modes):
            xs = [i + (j - 1) * w for i in range(len(rs))]
            ys = [r[m]["ttft_s"] * 1e3 for r in rs]
            bars = ax.bar(xs, ys, w, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(rs)), [f"{r['context']:,}" for r in rs])
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("TTFT of turn 2 on node B (ms)")
        full = rs[0]["full_layers"]
        ax.set_title(f"{shape} shape, {layers}{'' if layers == full else f' of {full}'} layers")
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['gpu']}: turn 2 on another node, recompute vs fetch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    path = sys.argv[1]
    with open(path) as f:
        doc = json.load(f)
    write_report(doc, path.removesuffix(".json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
