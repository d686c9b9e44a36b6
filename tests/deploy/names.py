"""The metric names that deploy/prometheus/rules.yml and deploy/grafana use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

# Series names Prometheus itself synthesizes (not exported by a daemon).
SYNTHETIC = {"up"}
_KVDIR = re.compile(r"\bkvdir_[a-zA-Z0-9_:]*")


def rule_exprs(path: Path) -> list[str]:
    doc = yaml.safe_load(path.read_text())
    return [str(r["expr"]) for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs(path: Path) -> list[str]:
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr" and isinstance(v, str):
                    out.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(path.read_text()))
    return out


def metric_names(expr: str) -> set[str]:
    """kvdir_* series names in a PromQL expression."""
    return set(_KVDIR.findall(expr))


def other_series(expr: str) -> set[str]:
    """Bare selectors that are not kvdir_* (so a typo'd prefix cannot slip by)."""
    stripped = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    stripped = re.sub(r"\"[^\"]*\"", '""', stripped)
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)  # range durations
    keywords = {
        "sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring",
        "group_left", "group_right", "bool", "and", "or", "unless", "rate", "increase",
        "delta", "histogram_quantile", "le", "offset",
    }  # fmt: skip
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped))
    grouping = set()
    for m in re.finditer(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", stripped
    ):
        grouping |= {s.strip() for s in m.group(1).split(",")}
    return {
        n
        for n in names - keywords - grouping
        if not n.startswith("kvdir_") and not re.fullmatch(r"\d.*|e", n)
    }
