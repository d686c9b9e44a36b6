"""What a chaos run records: operations with invoke/complete times, faults, events.

Every process of a run appends JSON lines to its own file; times are
`time.monotonic()` seconds, one clock for all processes of the machine.

An operation's outcome is one of:

- ``ok``: acknowledged (a read returned a value, a write committed);
- ``fail``: definitely had no effect (every attempt was refused or answered
  ``kvdir-outcome: not-applied``), left out of the checks;
- ``unknown``: may or may not have taken effect, at any time after its invoke.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TextIO

Outcome = Literal["ok", "fail", "unknown"]
Kind = Literal["publish", "remove", "read"]
Mode = Literal["", "lin", "local", "mirror"]


@dataclass(frozen=True, slots=True)
class Op:
    """One client operation on one key (a block of one agent)."""

    process: str
    kind: Kind
    key: str
    invoke: float
    complete: float
    """Completion time; `math.inf` for unknown outcomes once loaded for checking."""
    outcome: Outcome
    value: int | None = None
    """publish/remove: the generation written or guarding; read: the generation seen."""
    result: int | None = None
    """publish: 1 applied, 0 stale; remove: records removed (1 or 0)."""
    mode: Mode = ""
    replica: str = ""
    """The replica that answered (reads)."""
    applied_index: int = 0
    commit_index: int = 0
    """mirror reads: the highest commit index the mirror had heard of by then."""
    role: int = 0
    last_attempt: float = 0.0
    """When the last attempt began (unavailability is measured from retries)."""
    bad_record: str = ""
    """Set when a read returned a holder record that does not match its generation."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    start: float
    end: float
    """When the fault was healed (the replica restarted, the partition lifted)."""
    target: str = ""
    recovered: float = 0.0
    """When the cluster was whole again (0: it did not recover in time)."""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Event:
    """Anything else worth keeping: a replica (re)started, an agent crashed, ..."""

    kind: str
    at: float
    detail: dict[str, Any] = field(default_factory=dict)


def encode(record: Op | Fault | Event) -> str:
    tag = {Op: "op", Fault: "fault", Event: "event"}[type(record)]
    body = asdict(record)
    for k, v in body.items():
        if isinstance(v, float) and math.isinf(v):
            body[k] = None
    return json.dumps({"t": tag, **body}, separators=(",", ":"))


def decode(line: str) -> Op | Fault | Event:
    raw = json.loads(line)
    tag = raw.pop("t")
    if tag == "op":
        if raw.get("complete") is None:
            raw["complete"] = math.inf
        return Op(**raw)
    if tag == "fault":
        return Fault(**raw)
    if tag == "event":
        return Event(**raw)
    raise ValueError(f"unknown record tag {tag!r}")


class Recorder:
    """Appends records to one file, flushed per record (a killed process keeps its past)."""

    def __init__(self, f: TextIO) -> None:
        self.f = f

    def __call__(self, record: Op | Fault | Event) -> None:
        self.f.write(encode(record) + "\n")
        self.f.flush()


@dataclass(slots=True)
class History:
    ops: list[Op] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def add(self, record: Op | Fault | Event) -> None:
        if isinstance(record, Op):
            self.ops.append(record)
        elif isinstance(record, Fault):
            self.faults.append(record)
        else:
            self.events.append(record)


def load(lines: Iterable[str]) -> History:
    """A history from JSON lines; a torn last line (a killed writer) is skipped."""
    h = History()
    pending: list[str] = [ln for ln in lines if ln.strip()]
    for i, line in enumerate(pending):
        try:
            h.add(decode(line))
        except (json.JSONDecodeError, TypeError, KeyError):
            if i != len(pending) - 1:
                raise
    return h


def load_files(paths: Iterable[str]) -> History:
    out = History()
    for p in paths:
        with open(p) as f:
            part = load(f)
        out.ops += part.ops
        out.faults += part.faults
        out.events += part.events
    out.ops.sort(key=lambda o: o.invoke)
    out.faults.sort(key=lambda f: f.start)
    out.events.sort(key=lambda e: e.at)
    return out


def iter_ops(h: History, kind: Kind | None = None) -> Iterator[Op]:
    return (o for o in h.ops if kind is None or o.kind == kind)
