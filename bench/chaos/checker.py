"""Pure checks over a chaos history (no I/O, no clock): what a run must never show.

- `check_key`: per-key linearizability of writes and linearizable reads, a
  Wing-Gong search with Lowe's memoisation (linearized set, state). Unknown
  outcomes may take effect at any time after their invoke, or never.
- `lost_writes`: acknowledged publishes missing from the final state that no
  later write can explain.
- `local_reads`: reads through one replica never go backwards; their staleness.
  The same check over a client-side mirror's reads (mode "mirror"), plus
  `mirror_ahead`: a mirror never answered from past the commit index it knew.
- `lease_expiry`: a crashed agent's entries vanish within the bound.
- `unavailability`: per fault, how long writes and reads could not complete.

The key model mirrors `directory.table.Table` for one (node, tier) record of
one block: the value is the record's generation or None (absent).
``publish(g)`` stores g unless the stored generation is newer (then it is
counted stale); ``remove(g)`` removes the record when its generation is <= g.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.chaos.history import Event, Fault, History, Op

State = int | None
Verdict = Literal["ok", "violation", "undecided"]

SEARCH_STEPS_MAX = 2_000_000
"""Per key: past this many search steps the key is reported undecided (never passed)."""


def step(state: State, op: Op) -> tuple[bool, State]:
    """Apply `op` to one key's state: (consistent with what the op observed, next state)."""
    if op.kind == "read":
        return op.value == state, state
    g = op.value
    assert g is not None, f"{op.kind} without a generation"
    if op.kind == "publish":
        applied = state is None or g >= state
        if op.outcome == "ok" and op.result is not None and op.result != int(applied):
            return False, state
        return True, g if applied else state
    removed = state is not None and state <= g
    if op.outcome == "ok" and op.result is not None and op.result != int(removed):
        return False, state
    return True, None if removed else state


def check_key(
    ops: Sequence[Op],
    initial: State = None,
    steps_max: int = SEARCH_STEPS_MAX,
    model: Callable[[State, Op], tuple[bool, State]] = step,
) -> Verdict:
    """Is this single-key history linearizable? ("undecided" past `steps_max`).

    Failed operations are dropped (they had no effect). An unknown one gets an
    infinite completion: the search may place it anywhere after its invoke,
    or leave it out. Events are ordered by time, calls before returns at the
    same instant (equal times count as concurrent, the lenient reading).
    """
    live = [o for o in ops if o.outcome != "fail"]
    events: list[tuple[float, int, int]] = []
    for i, o in enumerate(live):
        events.append((o.invoke, 0, i))
        events.append((o.complete if o.outcome == "ok" else math.inf, 1, i))
    events.sort()
    m = len(events)
    # A doubly linked list of event nodes 1..m; node 0 is the head sentinel, -1 the end.
    nxt = [*range(1, m + 1), -1]
    prv = [-1, *range(0, m)]
    call_node = [0] * len(live)
    ret_node = [0] * len(live)
    for k, (_, typ, i) in enumerate(events):
        (ret_node if typ else call_node)[i] = k + 1

    def unlink(n: int) -> None:
        nxt[prv[n]] = nxt[n]
        if nxt[n] != -1:
            prv[nxt[n]] = prv[n]

    def relink(n: int) -> None:
        nxt[prv[n]] = n
        if nxt[n] != -1:
            prv[nxt[n]] = n

    state: State = initial
    bits = 0
    stack: list[tuple[int, State]] = []
    seen: set[tuple[int, State]] = set()
    e = nxt[0]
    steps = 0
    while e != -1:
        steps += 1
        if steps > steps_max:
            return "undecided"
        _, typ, i = events[e - 1]
        if typ == 0:
            ok, nxt_state = model(state, live[i])
            if ok:
                nbits = bits | (1 << i)
                if (nbits, nxt_state) not in seen:
                    seen.add((nbits, nxt_state))
                    stack.append((i, state))
                    state, bits = nxt_state, nbits
                    unlink(call_node[i])
                    unlink(ret_node[i])
                    e = nxt[0]
                    continue
            e = nxt[e]
            continue
        if live[i].outcome != "ok":
            return "ok"  # only unknown operations are left: each may never have happened
        if not stack:
            return "violation"
        j, state = stack.pop()
        bits &= ~(1 << j)
        relink(ret_node[j])
        relink(call_node[j])
        e = nxt[call_node[j]]
    return "ok"


def by_key(ops: Iterable[Op]) -> dict[str, list[Op]]:
    out: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        out[o.key].append(o)
    return dict(out)


def linearizability(ops: Iterable[Op], steps_max: int = SEARCH_STEPS_MAX) -> dict[str, Verdict]:
    """Verdict per key over writes and linearizable reads (local reads are not in it)."""
    checked = [o for o in ops if o.kind != "read" or o.mode == "lin"]
    return {k: check_key(v, steps_max=steps_max) for k, v in sorted(by_key(checked).items())}


def writes_of(ops: Iterable[Op]) -> dict[str, list[Op]]:
    """Per key, the writes that may have taken effect, in invoke order."""
    out = by_key(o for o in ops if o.kind != "read" and o.outcome != "fail")
    for v in out.values():
        v.sort(key=lambda o: o.invoke)
    return out


@dataclass(frozen=True, slots=True)
class Lost:
    key: str
    generation: int
    final: State


def lost_writes(ops: Iterable[Op], final: dict[str, State]) -> tuple[list[Lost], list[str]]:
    """Acknowledged publishes the final state does not show and no later write explains.

    Keys are written by one sequential writer each, so "later" is invoke
    order. Returns (lost, keys with acknowledged writes but no final read).
    """
    lost: list[Lost] = []
    unread: list[str] = []
    for key, ws in sorted(writes_of(ops).items()):
        if not any(w.outcome == "ok" for w in ws):
            continue
        if key not in final:
            unread.append(key)
            continue
        v = final[key]
        # later_remove[p]: the highest generation a remove after position p guards.
        later_remove = [-1] * (len(ws) + 1)
        for p in range(len(ws) - 1, -1, -1):
            w = ws[p]
            guard = w.value if w.kind == "remove" and w.value is not None else -1
            later_remove[p] = max(later_remove[p + 1], guard)
        for p, w in enumerate(ws):
            if w.kind != "publish" or w.outcome != "ok":
                continue
            g = w.value
            assert g is not None
            if v is not None and v >= g:
                continue
            if v is None and later_remove[p + 1] >= g:
                continue
            lost.append(Lost(key, g, v))
    return lost, unread


@dataclass(slots=True)
class LocalStats:
    reads: int = 0
    backwards: int = 0
    phantom: int = 0
    """Reads of a generation no write ever carried."""
    staleness: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)


def local_reads(
    ops: Sequence[Op],
    restarts: dict[str, list[float]],
    examples_max: int = 5,
    mode: str = "local",
) -> dict[str, LocalStats]:
    """Per replica: local reads never go backwards (within one process lifetime); staleness.

    Backwards means a smaller applied index, or an older generation of a key
    than one seen before, than an earlier read through the same replica
    process. Staleness of a read is how long before its invoke a write it
    does not reflect was acknowledged (0 when it reflects every write
    acknowledged before it began); a None read takes its most favourable
    position, so that figure is a lower bound there.
    """
    writes = writes_of(ops)
    index = {k: _KeyIndex(ws) for k, ws in writes.items()}
    empty = _KeyIndex([])
    out: dict[str, LocalStats] = defaultdict(LocalStats)
    last_index: dict[tuple[str, int], int] = {}
    last_gen: dict[tuple[str, int, str], int] = {}
    reads = sorted((o for o in ops if o.kind == "read" and o.mode == mode), key=lambda o: o.invoke)
    for r in reads:
        if r.outcome != "ok":
            continue
        st = out[r.replica]
        st.reads += 1
        # The process that answered is the one alive when the last attempt began
        # (a read retried across a restart is answered by the new one).
        session = bisect.bisect_left(restarts.get(r.replica, []), r.last_attempt)
        prev = last_index.get((r.replica, session), -1)
        if r.applied_index < prev:
            st.backwards += 1
            if len(st.examples) < examples_max:
                st.examples.append(f"{r.replica}: applied index {prev} -> {r.applied_index}")
        last_index[(r.replica, session)] = max(prev, r.applied_index)
        ki = index.get(r.key, empty)
        if r.value is not None:
            gk = (r.replica, session, r.key)
            if r.value < last_gen.get(gk, -1):
                st.backwards += 1
                if len(st.examples) < examples_max:
                    st.examples.append(
                        f"{r.replica} {r.key}: generation {last_gen[gk]} -> {r.value}"
                    )
            last_gen[gk] = max(last_gen.get(gk, -1), r.value)
            j = ki.publish_at.get(r.value)
            if j is None:
                st.phantom += 1
                continue
        else:
            # The most favourable None: the latest remove invoked before the read ended.
            n = bisect.bisect_left(ki.remove_invokes, r.complete)
            j = ki.remove_pos[n - 1] if n else -1
        # The writer is sequential, so acknowledgements come in position order: only
        # the first acknowledged write after j can have completed before the read.
        nxt = ki.next_ok[j + 1]
        stale = 0.0
        if nxt is not None and ki.ws[nxt].complete < r.invoke:
            stale = r.invoke - ki.ws[nxt].complete
        st.staleness.append(stale)
    return dict(out)


class _KeyIndex:
    """One key's writes (invoke order) indexed for `local_reads`."""

    def __init__(self, ws: Sequence[Op]) -> None:
        self.ws = ws
        self.publish_at: dict[int, int] = {}
        self.remove_invokes: list[float] = []
        self.remove_pos: list[int] = []
        for p, w in enumerate(ws):
            if w.kind == "publish" and w.value is not None:
                self.publish_at.setdefault(w.value, p)
            elif w.kind == "remove":
                self.remove_invokes.append(w.invoke)
                self.remove_pos.append(p)
        self.next_ok: list[int | None] = [None] * (len(ws) + 1)
        for p in range(len(ws) - 1, -1, -1):
            self.next_ok[p] = p if ws[p].outcome == "ok" else self.next_ok[p + 1]


@dataclass(frozen=True, slots=True)
class Expiry:
    node: str
    vanish_s: float | None
    bound_s: float

    @property
    def late(self) -> bool:
        return self.vanish_s is None or self.vanish_s > self.bound_s


def lease_expiry(events: Iterable[Event], election_s: float) -> list[Expiry]:
    """Each crashed agent: did its entries vanish within lease + sweep + one election?

    A leader change while waiting adds one lease (a new leader restarts every
    lease when it takes over; docs/directory.md).
    """
    out = []
    for e in events:
        if e.kind != "agent-crash":
            continue
        d = e.detail
        bound = d["lease_ms"] / 1000 + d["sweep_ms"] / 1000 + election_s
        if d.get("leader_changed"):
            bound += d["lease_ms"] / 1000
        gone = d.get("vanished_at")
        out.append(Expiry(d["node"], None if gone is None else gone - e.at, bound))
    return out


def _first_ok_after(ops: Sequence[Op], t: float) -> float | None:
    """Completion of the first acknowledged op whose last attempt began at or after `t`."""
    best: float | None = None
    for o in ops:
        if o.outcome == "ok" and o.last_attempt >= t and (best is None or o.complete < best):
            best = o.complete
    return best


def _max_gap(ops: Sequence[Op], start: float, end: float) -> float | None:
    """Longest time without an acknowledged completion within [start, end].

    Measured from the last completion before `start`; a silence running past
    `end` counts only up to `end`. None when nothing completed before `start`.
    """
    times = sorted(o.complete for o in ops if o.outcome == "ok")
    i = bisect.bisect_left(times, start)
    if i == 0:
        return None
    pts = [*times[i - 1 : bisect.bisect_right(times, end)], end]
    return max(b - a for a, b in itertools.pairwise(pts))


@dataclass(frozen=True, slots=True)
class FaultCost:
    kind: str
    start: float
    write_s: float | None
    lin_read_s: float | None
    follower_read_gap_s: float | None
    recovered: bool


def unavailability(
    ops: Sequence[Op], faults: Iterable[Fault], gap_window_s: float = 3.0
) -> list[FaultCost]:
    """Per fault: time from injection to the first acknowledged write (and linearizable
    read) attempted after it, and the longest gap between local reads answered by
    replicas other than the fault's target around it."""
    writes = [o for o in ops if o.kind != "read" and not o.process.startswith(("crash-", "probe"))]
    lin = [
        o for o in ops if o.kind == "read" and o.mode == "lin" and not o.process.startswith("probe")
    ]
    local = [o for o in ops if o.kind == "read" and o.mode == "local"]
    out = []
    run_end = max((o.complete for o in local if o.outcome == "ok"), default=0.0)
    faults = sorted(faults, key=lambda f: f.start)
    for n, f in enumerate(faults):
        # The gap window ends where the next fault begins: each fault is charged only its own.
        window_end = f.start + gap_window_s
        if n + 1 < len(faults):
            window_end = min(window_end, faults[n + 1].start)
        window_end = min(window_end, run_end)
        w = _first_ok_after(writes, f.start)
        r = _first_ok_after(lin, f.start)
        others = [o for o in local if o.replica and o.replica not in f.target.split(",")]
        gaps = []
        for rep in sorted({o.replica for o in others}):
            g = _max_gap([o for o in others if o.replica == rep], f.start, window_end)
            if g is not None:
                gaps.append(g)
        out.append(
            FaultCost(
                f.kind,
                f.start,
                None if w is None else w - f.start,
                None if r is None else r - f.start,
                max(gaps) if gaps else None,
                f.recovered > 0,
            )
        )
    return out


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """n, median, p99, max of the known values, and how many were unknown (None)."""
    vals = sorted(v for v in values if v is not None)
    missing = len(values) - len(vals)
    out: dict[str, Any] = {"n": len(vals)}
    if missing:
        out["missing"] = missing
    if vals:
        out["median"] = round(statistics.median(vals), 4)
        out["p99"] = round(vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)], 4)
        out["max"] = round(vals[-1], 4)
    return out


def convergence(events: Iterable[Event]) -> tuple[bool, dict[str, Any]]:
    """The last convergence event: did every replica report the same state digest?"""
    last = [e for e in events if e.kind == "convergence"]
    if not last:
        return False, {}
    d = last[-1].detail
    digests = d.get("digests", {})
    ok = bool(digests) and len(digests) == d.get("replicas", -1) and len(set(digests.values())) == 1
    return ok, d


def mirror_ahead(ops: Iterable[Op], examples_max: int = 5) -> tuple[int, list[str]]:
    """Mirror reads answered at an applied index past the commit index the mirror
    had heard of (a mirror may only replay what replicas applied, all committed)."""
    bad = [
        o
        for o in ops
        if o.kind == "read"
        and o.mode == "mirror"
        and o.outcome == "ok"
        and o.applied_index > o.commit_index
    ]
    return len(bad), [
        f"{o.replica} {o.key}: applied index {o.applied_index} > commit {o.commit_index}"
        for o in bad[:examples_max]
    ]


@dataclass
class Report:
    figures: dict[str, Any]
    violations: list[str]
    """Human-readable failures; empty when the run passed every check."""


def check(h: History, election_s: float = 1.0) -> Report:
    """Every check over one run's history, as figures plus a list of failures."""
    ops = h.ops
    checked_ops = [o for o in ops if not o.process.startswith("crash-")]
    verdicts = linearizability(checked_ops)
    bad_keys = [k for k, v in verdicts.items() if v == "violation"]
    undecided = [k for k, v in verdicts.items() if v == "undecided"]
    final = {str(e.detail["key"]): e.detail["value"] for e in h.events if e.kind == "final-read"}
    lost, unread = lost_writes(checked_ops, final)
    restarts: dict[str, list[float]] = defaultdict(list)
    for e in h.events:
        if e.kind == "replica-start":
            restarts[e.detail["replica"]].append(e.at)
    local = local_reads(checked_ops, restarts)
    mirror = local_reads(checked_ops, {}, mode="mirror")  # one process each, never restarted
    ahead, ahead_examples = mirror_ahead(checked_ops)
    expiries = lease_expiry(h.events, election_s)
    converged, conv = convergence(h.events)
    costs = unavailability(ops, h.faults)
    wrong = sum(1 for o in ops if o.bad_record)
    writes = [o for o in ops if o.kind != "read"]
    reads = [o for o in ops if o.kind == "read"]

    fault_counts: dict[str, int] = defaultdict(int)
    for f in h.faults:
        fault_counts[f.kind] += 1
    per_kind: dict[str, Any] = {}
    for kind in sorted(fault_counts):
        cs = [c for c in costs if c.kind == kind]
        per_kind[kind] = {
            "count": len(cs),
            "not_recovered": sum(1 for c in cs if not c.recovered),
            "write_unavailable_s": summary([c.write_s for c in cs]),
            "lin_read_unavailable_s": summary([c.lin_read_s for c in cs]),
            "follower_local_read_gap_s": summary([c.follower_read_gap_s for c in cs]),
        }
    stale_leader = [e for e in h.events if e.kind == "stale-leader-served"]
    figures: dict[str, Any] = {
        "faults": sum(fault_counts.values()),
        "faults_by_kind": dict(sorted(fault_counts.items())),
        "operations": len(ops),
        "writes": len(writes),
        "acknowledged": sum(1 for o in writes if o.outcome == "ok"),
        "writes_unknown": sum(1 for o in writes if o.outcome == "unknown"),
        "writes_failed": sum(1 for o in writes if o.outcome == "fail"),
        "reads_ok": sum(1 for o in reads if o.outcome == "ok"),
        "lin_reads_ok": sum(1 for o in reads if o.outcome == "ok" and o.mode == "lin"),
        "local_reads_ok": sum(1 for o in reads if o.outcome == "ok" and o.mode == "local"),
        "keys_checked": len(verdicts),
        "lost": len(lost),
        "unread_keys": len(unread),
        "linearizability_violations": len(bad_keys),
        "undecided_keys": len(undecided),
        "wrong_records": wrong,
        "local_backwards": sum(s.backwards for s in local.values()),
        "local_phantom": sum(s.phantom for s in local.values()),
        "local_staleness_s": {rep: summary(s.staleness) for rep, s in sorted(local.items())},
        "mirror_reads_ok": sum(1 for o in reads if o.outcome == "ok" and o.mode == "mirror"),
        "mirror_backwards": sum(s.backwards for s in mirror.values()),
        "mirror_phantom": sum(s.phantom for s in mirror.values()),
        "mirror_ahead": ahead,
        "mirror_staleness_s": {m: summary(s.staleness) for m, s in sorted(mirror.items())},
        "agent_crashes": len(expiries),
        "lease_late": sum(1 for x in expiries if x.late),
        "lease_vanish_s": summary([x.vanish_s for x in expiries]),
        "lease_bound_s": round(max((x.bound_s for x in expiries), default=0.0), 3),
        "converged": converged,
        "stale_leader_served": len(stale_leader),
        "unavailability": per_kind,
    }
    violations: list[str] = []
    for x in lost[:20]:
        violations.append(f"lost: key {x.key} generation {x.generation} (final {x.final})")
    violations += [f"not linearizable: key {k}" for k in bad_keys[:20]]
    violations += [f"undecided (search too long): key {k}" for k in undecided[:20]]
    violations += [f"no final read: key {k}" for k in unread[:20]]
    violations += [f"wrong record: {o.key} {o.bad_record}" for o in ops if o.bad_record][:20]
    for s in local.values():
        violations += [f"local read went backwards: {x}" for x in s.examples]
        if s.phantom:
            violations.append(f"local read of a generation never written ({s.phantom})")
    for s in mirror.values():
        violations += [f"mirror read went backwards: {x}" for x in s.examples]
        if s.phantom:
            violations.append(f"mirror read of a generation never written ({s.phantom})")
    violations += [f"mirror read ahead of the commit index: {x}" for x in ahead_examples]
    violations += [
        f"agent {x.node} entries vanished after {x.vanish_s} s (bound {x.bound_s:.2f} s)"
        for x in expiries
        if x.late
    ]
    if not converged:
        violations.append(f"replicas did not converge: {conv}")
    violations += [f"stale leader served: {e.detail}" for e in stale_leader]
    return Report(figures, violations)
