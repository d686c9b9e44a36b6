"""Benchmark targets as data: a `Goal` names a result path, a bound and a unit.

`check(goals, results)` turns them into `kvdir.report.Target`s (the rows of
the Targets table and the JSON `targets` list). A goal whose path is missing
from the results is reported as not measured (`-`), never as a failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvdir.report import Target, at_least, at_most

Op = Literal["<=", ">=", "info", "yes"]


@dataclass(frozen=True, slots=True)
class Goal:
    key: str
    name: str
    path: tuple[str | int, ...]
    """Keys into the results; an int indexes a list (a row of a per-case section)."""
    op: Op
    limit: float = 0.0
    unit: str = ""
    info_goal: str = "-"
    """The Goal column of an `info` target."""


def lookup(results: Mapping[str, Any], path: Sequence[str | int]) -> Any:
    cur: Any = results
    for p in path:
        if not isinstance(cur, Mapping | list):
            return None
        container: Any = cur  # a str key into a list is a TypeError, caught
        try:
            cur = container[p]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) else None


def check(goal: Goal, results: Mapping[str, Any]) -> Target:
    v = lookup(results, goal.path)
    if goal.op == "yes":
        return Target(
            goal.key, goal.name, "yes", _number(v), "bool", None if v is None else bool(v)
        )
    if goal.op == "<=":
        return at_most(goal.key, goal.name, _number(v), goal.limit, goal.unit)
    if goal.op == ">=":
        return at_least(goal.key, goal.name, _number(v), goal.limit, goal.unit)
    return Target(goal.key, goal.name, goal.info_goal, _number(v), goal.unit, None)


def check_all(goals: Sequence[Goal], results: Mapping[str, Any]) -> list[Target]:
    return [check(g, results) for g in goals]


def from_dict(t: Mapping[str, Any]) -> Target:
    """A Target back from its JSON form (`Target.as_dict`)."""
    return Target(t["key"], t["name"], t["goal"], t["measured"], t["unit"], t["pass"])
