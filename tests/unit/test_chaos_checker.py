"""The chaos checker on hand-made histories: what must pass passes, what must be flagged is."""

from __future__ import annotations

import math
import random

import pytest

from bench.chaos import checker, history
from bench.chaos.history import Event, Fault, History, Op, Outcome

INF = math.inf


def pub(
    g: int, t0: float, t1: float, out: Outcome = "ok", result: int | None = None, key: str = "k"
) -> Op:
    return Op(
        "w",
        "publish",
        key,
        t0,
        t1 if out == "ok" else INF,
        out,
        value=g,
        result=result,
        last_attempt=t0,
    )


def rem(
    g: int, t0: float, t1: float, out: Outcome = "ok", result: int | None = None, key: str = "k"
) -> Op:
    return Op(
        "w",
        "remove",
        key,
        t0,
        t1 if out == "ok" else INF,
        out,
        value=g,
        result=result,
        last_attempt=t0,
    )


def rd(v: int | None, t0: float, t1: float, key: str = "k", mode: str = "lin", **kw: object) -> Op:
    return Op("r", "read", key, t0, t1, "ok", value=v, mode=mode, last_attempt=t0, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------ linearizability


def test_sequential_history_passes() -> None:
    assert checker.check_key([pub(1, 0, 1), rd(1, 2, 3), pub(2, 4, 5), rd(2, 6, 7)]) == "ok"


def test_read_missing_an_acknowledged_write_is_flagged() -> None:
    assert checker.check_key([pub(1, 0, 1), rd(None, 2, 3)]) == "violation"


def test_read_going_back_to_an_older_generation_is_flagged() -> None:
    ops = [pub(1, 0, 1), pub(2, 2, 3), rd(2, 4, 5), rd(1, 6, 7)]
    assert checker.check_key(ops) == "violation"


@pytest.mark.parametrize("seen", [None, 1])
def test_a_read_concurrent_with_a_write_may_see_either(seen: int | None) -> None:
    assert checker.check_key([pub(1, 0, 3), rd(seen, 1, 2)]) == "ok"


def test_two_concurrent_reads_cannot_disagree_in_the_wrong_order() -> None:
    # The second read began after the first completed and saw the older state.
    assert checker.check_key([pub(1, 0, 10), rd(1, 1, 2), rd(None, 3, 4)]) == "violation"


@pytest.mark.parametrize("seen", [None, 1])
def test_an_unknown_write_may_or_may_not_take_effect(seen: int | None) -> None:
    assert checker.check_key([pub(1, 0, 0, out="unknown"), rd(seen, 5, 6)]) == "ok"


def test_an_unknown_write_cannot_take_effect_and_then_undo_itself() -> None:
    ops = [pub(1, 0, 0, out="unknown"), rd(1, 5, 6), rd(None, 7, 8)]
    assert checker.check_key(ops) == "violation"


def test_a_failed_write_must_not_be_seen() -> None:
    assert checker.check_key([pub(1, 0, 0, out="fail"), rd(1, 5, 6)]) == "violation"


def test_an_acknowledged_result_must_match_the_model() -> None:
    # Publish reported "stale" on an empty key: impossible.
    assert checker.check_key([pub(1, 0, 1, result=0)]) == "violation"
    assert checker.check_key([pub(1, 0, 1, result=1)]) == "ok"
    # An older generation is stale; the newer one stays.
    ops = [pub(5, 0, 1, result=1), pub(3, 2, 3, result=0), rd(5, 4, 5)]
    assert checker.check_key(ops) == "ok"


def test_a_generation_guarded_remove_leaves_a_newer_record() -> None:
    ops = [pub(2, 0, 1), rem(1, 2, 3, result=0), rd(2, 4, 5)]
    assert checker.check_key(ops) == "ok"
    assert checker.check_key([pub(2, 0, 1), rem(1, 2, 3, result=1)]) == "violation"
    assert checker.check_key([pub(2, 0, 1), rem(2, 2, 3, result=1), rd(None, 4, 5)]) == "ok"


def random_history(rng: random.Random, n: int) -> list[Op]:
    """A real execution: one writer, concurrent readers, each op takes effect at a
    random point inside its interval; reads return the state at that point."""
    events: list[tuple[float, str, int, float, float]] = []  # (point, kind, g, t0, t1)
    t = 0.0
    for g in range(1, n + 1):
        t0 = t + rng.random()
        t1 = t0 + rng.random() * 2
        kind = "remove" if rng.random() < 0.2 else "publish"
        events.append((rng.uniform(t0, t1), kind, g, t0, t1))
        t = t1
    for _ in range(3 * n):
        t0 = rng.uniform(0, t)
        t1 = t0 + rng.random() * 3
        events.append((rng.uniform(t0, t1), "read", 0, t0, t1))
    events.sort()
    state: int | None = None
    ops = []
    for _, kind, g, t0, t1 in events:
        if kind == "publish":
            ops.append(pub(g, t0, t1, result=1))
            state = g
        elif kind == "remove":
            removed = state is not None and state <= g
            ops.append(rem(g, t0, t1, result=int(removed)))
            state = None if removed else state
        else:
            ops.append(rd(state, t0, t1))
    return ops


@pytest.mark.parametrize("seed", range(20))
def test_real_executions_pass_and_a_corrupted_read_is_flagged(seed: int) -> None:
    rng = random.Random(seed)
    ops = random_history(rng, 40)
    assert checker.check_key(ops) == "ok"
    # The last write happens after every other write's interval; a read that starts
    # after it completed and still sees an older value must be flagged.
    last = max((o for o in ops if o.kind != "read"), key=lambda o: o.complete)
    stale = rd(-1, last.complete + 100, last.complete + 101)
    assert checker.check_key([*ops, stale]) == "violation"


def test_a_history_too_long_to_search_is_undecided_never_passed() -> None:
    ops = [
        pub(1, 0, 0, out="unknown"),
        *[rd(None, i, i + 0.5) for i in range(1, 50)],
        rd(2, 60, 61),
    ]
    assert checker.check_key(ops, steps_max=10) == "undecided"


def test_local_reads_are_not_part_of_the_linearizability_check() -> None:
    verdicts = checker.linearizability([pub(1, 0, 1), rd(None, 2, 3, mode="local")])
    assert verdicts == {"k": "ok"}


# ------------------------------------------------------------ lost writes


def test_an_acknowledged_publish_missing_at_the_end_is_lost() -> None:
    lost, unread = checker.lost_writes([pub(1, 0, 1), pub(2, 2, 3)], {"k": None})
    assert [(x.key, x.generation) for x in lost] == [("k", 1), ("k", 2)]
    assert unread == []
    lost, _ = checker.lost_writes([pub(1, 0, 1), pub(2, 2, 3)], {"k": 1})
    assert [(x.key, x.generation) for x in lost] == [("k", 2)]


def test_a_later_remove_explains_a_missing_publish() -> None:
    ops = [pub(1, 0, 1), rem(1, 2, 3, out="unknown")]
    assert checker.lost_writes(ops, {"k": None}) == ([], [])
    assert checker.lost_writes([pub(1, 0, 1), pub(2, 2, 3)], {"k": 2}) == ([], [])


def test_a_key_without_a_final_read_is_reported() -> None:
    assert checker.lost_writes([pub(1, 0, 1)], {}) == ([], ["k"])


# ------------------------------------------------------------ local reads


def local(v: int | None, t0: float, idx: int, replica: str = "r1") -> Op:
    return rd(v, t0, t0 + 0.1, mode="local", replica=replica, applied_index=idx)


def test_local_reads_going_backwards_are_flagged_within_one_process_life() -> None:
    ops = [pub(1, 0, 1), pub(2, 2, 3), local(2, 4, 10), local(1, 5, 11)]
    st = checker.local_reads(ops, {})
    assert st["r1"].backwards == 1
    st = checker.local_reads([pub(1, 0, 1), local(1, 4, 10), local(1, 5, 9)], {})
    assert st["r1"].backwards == 1
    # The replica restarted in between: its new life starts from its journal.
    st = checker.local_reads([pub(1, 0, 1), local(1, 4, 10), local(1, 6, 9)], {"r1": [5.0]})
    assert st["r1"].backwards == 0
    # A read invoked before the restart, retried, and answered by the new process.
    retried = Op(
        "r",
        "read",
        "k",
        4.5,
        6.5,
        "ok",
        value=1,
        mode="local",
        replica="r1",
        applied_index=9,
        last_attempt=6.0,
    )
    st = checker.local_reads([pub(1, 0, 1), local(1, 4, 10), retried], {"r1": [5.0]})
    assert st["r1"].backwards == 0


def test_local_read_staleness_is_measured_from_the_missed_acknowledgement() -> None:
    ops = [pub(1, 0, 1), pub(2, 2, 3), local(1, 10, 5), local(2, 11, 6)]
    st = checker.local_reads(ops, {})
    assert st["r1"].staleness == [pytest.approx(7.0), 0.0]
    assert checker.local_reads([local(7, 1, 1)], {})["r1"].phantom == 1


def mirrored(v: int | None, t0: float, idx: int, commit: int) -> Op:
    return rd(
        v, t0, t0 + 0.1, mode="mirror", replica="mirror-0", applied_index=idx, commit_index=commit
    )


def test_mirror_reads_backwards_or_ahead_of_the_commit_index_are_violations() -> None:
    final = [
        Event("final-read", 9, {"key": "k", "value": 2}),
        Event("convergence", 9, {"digests": {"r1": "aa"}, "replicas": 1}),
    ]
    good = [pub(1, 0, 1), pub(2, 2, 3), mirrored(1, 1.5, 4, 4), mirrored(2, 4, 6, 9)]
    rep = checker.check(History(ops=good, events=final))
    assert rep.violations == [] and rep.figures["mirror_reads_ok"] == 2
    assert rep.figures["mirror_staleness_s"]["mirror-0"]["n"] == 2
    back = [pub(1, 0, 1), pub(2, 2, 3), mirrored(2, 4, 6, 6), mirrored(1, 5, 5, 7)]
    rep = checker.check(History(ops=back, events=final))
    assert rep.figures["mirror_backwards"] == 2  # index and generation
    assert any("mirror read went backwards" in v for v in rep.violations)
    ahead = [pub(1, 0, 1), pub(2, 2, 3), mirrored(2, 4, 8, 7)]
    rep = checker.check(History(ops=ahead, events=final))
    assert rep.figures["mirror_ahead"] == 1
    assert rep.violations == [
        "mirror read ahead of the commit index: mirror-0 k: applied index 8 > commit 7"
    ]
    phantom = [pub(1, 0, 1), mirrored(5, 2, 3, 3)]
    assert any("never written" in v for v in checker.check(History(ops=phantom)).violations)


# ------------------------------------------------------------ leases, faults


def crash(at: float, vanished: float | None, changed: bool = False) -> Event:
    return Event(
        "agent-crash",
        at,
        {
            "node": "crash-1",
            "lease_ms": 1500,
            "sweep_ms": 250,
            "vanished_at": vanished,
            "leader_changed": changed,
        },
    )


def test_lease_expiry_bound() -> None:
    ok, late, never, changed = checker.lease_expiry(
        [crash(0, 2.0), crash(10, 13.0), crash(20, None), crash(30, 34.0, True)], 1.0
    )
    assert not ok.late and late.late and never.late and not changed.late
    assert ok.bound_s == pytest.approx(2.75)


def test_unavailability_per_fault() -> None:
    ops = [
        pub(1, 0.0, 0.1),
        Op(
            "w", "publish", "k", 0.2, 1.4, "ok", value=2, last_attempt=1.3
        ),  # retried after the fault
        rd(2, 1.5, 1.6),
        local(1, 0.0, 1, "r2"),
        local(1, 0.5, 1, "r2"),
        local(1, 1.2, 1, "r2"),
        local(1, 1.4, 1, "r2"),
    ]
    (cost,) = checker.unavailability(ops, [Fault("kill-leader", 1.0, 1.1, "r1", 1.5)])
    assert cost.write_s == pytest.approx(0.4)
    assert cost.lin_read_s == pytest.approx(0.6)
    assert cost.follower_read_gap_s == pytest.approx(0.7)  # 0.6 -> 1.3 completions


def test_check_flags_lost_writes_divergence_and_stale_leaders() -> None:
    h = History(
        ops=[pub(1, 0, 1), rd(None, 2, 3)],
        events=[
            Event("final-read", 5, {"key": "k", "value": None}),
            Event(
                "convergence", 6, {"digests": {"r1": "aa", "r2": "bb", "r3": "aa"}, "replicas": 3}
            ),
            Event("stale-leader-served", 4, {"replica": "r1"}),
        ],
    )
    rep = checker.check(h)
    assert rep.figures["lost"] == 1
    assert rep.figures["linearizability_violations"] == 1
    assert rep.figures["converged"] is False
    assert rep.figures["stale_leader_served"] == 1
    assert len(rep.violations) >= 4


def test_a_clean_history_passes_the_whole_check() -> None:
    h = History(
        ops=[pub(1, 0, 1), rd(1, 2, 3), local(1, 4, 3, "r2")],
        events=[
            Event("final-read", 5, {"key": "k", "value": 1}),
            Event(
                "convergence", 6, {"digests": {"r1": "aa", "r2": "aa", "r3": "aa"}, "replicas": 3}
            ),
        ],
    )
    rep = checker.check(h)
    assert rep.violations == []
    assert rep.figures["acknowledged"] == 1


def test_history_lines_round_trip_and_a_torn_tail_is_skipped() -> None:
    recs: list[Op | Fault | Event] = [
        pub(1, 0, 1),
        pub(2, 2, 0, out="unknown"),
        Fault("kill-leader", 1, 2, "r1", 3),
        Event("replica-start", 2, {"replica": "r1"}),
    ]
    lines = [history.encode(r) for r in recs]
    h = history.load([*lines, lines[0][:10]])
    assert h.ops == recs[:2] and h.faults == [recs[2]] and h.events == [recs[3]]
    assert h.ops[1].complete == INF
