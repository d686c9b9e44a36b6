"""PNG plots of a replay: TTFT CDF per scenario, hit rate versus cluster size.

matplotlib is imported lazily with the non-interactive Agg backend, so the
replay runs headless and only pays for the import when it draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CDF_POINTS_MAX = 2000
"""Points per CDF curve (evenly spaced ranks), enough for a smooth line."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for r in rows:
        xs: Sequence[float] = r["ttft_sorted_s"]
        if not xs:
            continue
        step = max(1, len(xs) // CDF_POINTS_MAX)
        idx = [*range(0, len(xs), step), len(xs) - 1]
        ax.plot(
            [xs[i] * 1e3 for i in idx],
            [(i + 1) / len(xs) for i in idx],
            label=r["label"],
            linestyle="--" if r.get("modelled_link") else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def hit_vs_nodes(sweep: Mapping[str, Mapping[int, float]], path: Path, title: str) -> Path:
    """`sweep`: scenario label -> {nodes: hit rate}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, points in sweep.items():
        ns = sorted(points)
        ax.plot(ns, [points[n] * 100 for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({n for p in sweep.values() for n in p}))
    ax.get_xaxis().set_major_formatter(_int_formatter())
    ax.set_xlabel("nodes")
    ax.set_ylabel("hit rate over reusable prefix blocks (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _int_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{int(v)}")
