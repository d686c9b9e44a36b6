"""What every benchmark result carries: machine, command, date; Markdown and JSON output.

A result is only comparable with another when it says where and how it was
measured, so `header()` records the CPU model, cores, memory, Python and key
library versions, the git commit, the exact command line and the UTC time.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


PRODUCT_SOURCES = (
    "directory",
    "proto",
    "agent",
    "transfer",
    "kvdir/core",
    "kvdir/local.py",
    "kvdir/cli.py",
)


def source_fingerprint() -> str:
    """sha256 over the product code the benchmark runs (to detect edits during a run)."""
    h = hashlib.sha256()
    for top in PRODUCT_SOURCES:
        path = REPO_ROOT / top
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            if f.is_file():
                h.update(str(f.relative_to(REPO_ROOT)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``kvdir ...`` or ``python -m kvdir.cli ...``."""
    argv = list(sys.argv if argv is None else argv)
    prog = os.path.basename(argv[0]) if argv else "kvdir"
    head = ["kvdir"] if prog == "kvdir" else ["python", "-m", "kvdir.cli"]
    return shlex.join([*head, *argv[1:]])


def header(started: dt.datetime) -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    commit = _git("rev-parse", "--short=12", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "machine": {
            "cpu_model": _cpu_model(),
            "cores": os.cpu_count() or 0,
            "cores_usable": usable,
            "memory_bytes": _mem_total_bytes(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "python_impl": platform.python_implementation(),
        },
        "versions": {d: _version(d) for d in ("grpcio", "protobuf", "pysyncobj", "kvdir")},
        "git_commit": commit + ("-dirty" if commit and dirty else ""),
        "source_fingerprint": source_fingerprint(),
        "loadavg_start": _loadavg(),
        "command": command_line(),
        "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# --------------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Target:
    key: str
    name: str
    goal: str
    measured: float | None
    unit: str
    passed: bool | None
    """None: informational, or not measured."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "name": self.name,
            "goal": self.goal,
            "measured": self.measured,
            "unit": self.unit,
            "pass": self.passed,
        }


def at_most(key: str, name: str, measured: float | None, limit: float, unit: str) -> Target:
    ok = None if measured is None else measured <= limit
    return Target(key, name, f"<= {fmt(limit)} {unit}".strip(), measured, unit, ok)


def at_least(key: str, name: str, measured: float | None, limit: float, unit: str) -> Target:
    ok = None if measured is None else measured >= limit
    return Target(key, name, f">= {fmt(limit)} {unit}".strip(), measured, unit, ok)


def fmt(v: Any, digits: int = 3) -> str:
    """Numbers for people: 3 significant digits, thousands separated, no 1e+05."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        mag = math.floor(math.log10(abs(v)))
        if mag >= digits - 1:
            return f"{round(v):,}"
        return f"{v:.{digits - 1 - mag}f}"
    return str(v)


def _verdict(p: bool | None) -> str:
    return {True: "PASS", False: "**MISS**", None: "info"}[p]


def table(rows: Sequence[Sequence[Any]], head: Sequence[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(c) for c in r) + " |")
    return "\n".join(lines)


def _measured(t: Target) -> str:
    if t.unit == "bool":
        return "-" if t.measured is None else ("yes" if t.measured else "no")
    return f"{fmt(t.measured)} {t.unit}".strip()


def targets_table(targets: Sequence[Target]) -> str:
    rows = [(t.name, t.goal, _measured(t), _verdict(t.passed)) for t in targets]
    return table(rows, ["Target", "Goal", "Measured", "Result"])


def header_markdown(h: dict[str, Any]) -> str:
    m = h["machine"]
    v = h["versions"]
    rows = [
        (
            "Machine",
            f"{m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), "
            f"{m['memory_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}",
        ),
        (
            "Python",
            f"{m['python_impl']} {m['python']}; grpcio {v['grpcio']}, "
            f"protobuf {v['protobuf']}, pysyncobj {v['pysyncobj']}",
        ),
        (
            "Commit",
            f"{h['git_commit'] or '-'}; product sources sha256 {h.get('source_fingerprint', '-')}"
            + (
                ""
                if h.get("source_fingerprint_end") in (None, h.get("source_fingerprint"))
                else f" -> **{h['source_fingerprint_end']} (product code changed during the run)**"
            ),
        ),
        ("Command", f"`{h['command']}`"),
        ("Date (UTC)", h["started_utc"]),
    ]
    if "wall_s" in h:
        rows.append(("Run time", f"{h['wall_s']:.0f} s"))
    if h.get("loadavg_start"):
        rows.append(
            (
                "Load average at start (1/5/15 min)",
                " / ".join(f"{x:.2f}" for x in h["loadavg_start"])
                + f" on {m['cores']} cores (the host may be shared; see Host load per phase)",
            )
        )
    return table(rows, ["", ""])


def write(out_dir: Path, stem: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(markdown)
    js.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    return md, js


def _json_default(o: object) -> object:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile `q` (0..100) of an already sorted sequence."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    a, b, frac = sorted_values[lo], sorted_values[hi], pos - lo
    if frac == 0 or a == b:  # exact, and no inf - inf (a failed request is infinitely late)
        return a
    return a + (b - a) * frac
