"""The mirror inside the seeded simulator (bench/sim/mirrors.py; issue 29).

A real `Mirror` follows the real Watch service of one simulated replica at a
time and moves on when that replica crashes. These tests show that the
mirror checks pass on a run with crashes and power cuts, where the mirror
loses its source and resumes elsewhere (from a snapshot when it must), and
that each check fails when the events are tampered with.
"""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.checks import MirrorChecks
from bench.sim.knobs import Knobs
from bench.sim.mirrors import MirrorKnobs, SimMirror
from bench.sim.net import NetFaults
from bench.sim.simulation import Simulation
from kvdir.directory import codec
from kvdir.directory.commands import Publish
from kvdir.v1 import directory_pb2 as pb

pytestmark = pytest.mark.filterwarnings(
    # as in test_raft_sim.py: pysyncobj drops a snapshot file without closing it
    "ignore::pytest.PytestUnraisableExceptionWarning",
    "ignore::ResourceWarning",
)

Busy = Knobs(
    net=NetFaults(),
    crash=0.0,
    power_loss=0.0,
    blackout=0.0,
    restart=0.2,
    partition=0.0,
    heal=0.05,
    transfer=0.0,
    compact=0.0,
    op=1.0,
    bulk=0.0,
    dump_delay_steps_max=0,
    compaction_min_entries=20_000,
    compaction_min_time_s=600.0,
)
"""No faults, a client operation every step: the mirror has a lot to follow."""
Crashes = dataclasses.replace(
    Busy, crash=0.01, power_loss=0.5, compact=0.02, compaction_min_entries=30
)


def test_the_mirror_resumes_on_another_replica_after_its_source_crashes() -> None:
    for seed in range(1, 6):
        res = Simulation(seed, 400, knobs=Crashes).run()
        assert res.ok, res.summary()
        assert res.stats["mirror"]["applied"] > 0, res.summary()
        lines = res.trace
        lost = [i for i, ln in enumerate(lines) if "mirror: lost its stream" in ln]
        if lost and any("mirror: follows" in ln for ln in lines[lost[0] :]):
            return
    raise AssertionError("no seed's mirror lost its source to a crash and resumed elsewhere")


def test_a_mirror_the_history_no_longer_covers_resyncs_from_a_snapshot() -> None:
    """A Watch history of 4 commands and a mirror that often moves on: resuming needs
    a snapshot, and the mirror's table still matches the replicas'."""
    restless = MirrorKnobs(stall=0.5, wander=0.05, history_entries_max=4)
    res = Simulation(1, 400, knobs=Crashes, mirror_knobs=restless).run()
    assert res.ok, res.summary()
    assert res.stats["mirror"]["snapshots"] >= 2, res.stats
    assert res.stats["mirror"]["digests"] > 0, res.stats


def _corrupt_publishes(ev: pb.WatchEvent) -> pb.WatchEvent:
    """Every published generation + 1000: the mirror's table differs from the replicas'."""
    for i, blob in enumerate(ev.entries.commands):
        cmd = codec.decode(blob)
        if isinstance(cmd, Publish):
            bad = dataclasses.replace(cmd, generations=[g + 1000 for g in cmd.generations])
            ev.entries.commands[i] = codec.encode(bad)
    return ev


def _jump_ahead(ev: pb.WatchEvent) -> pb.WatchEvent:
    """A heartbeat claiming three more entries applied than the replica has."""
    if ev.HasField("heartbeat"):
        ev.applied_index += 3
    return ev


def test_a_corrupted_command_makes_the_mirror_digest_differ() -> None:
    res = Simulation(3, 300, knobs=Busy, tamper=_corrupt_publishes).run()
    assert "digest_differs" in {v.kind for v in res.violations}, res.summary()
    assert "seed 3" in res.summary() and "mirror" in res.summary()


def test_an_event_past_the_commit_index_is_caught() -> None:
    res = Simulation(3, 300, knobs=Busy, tamper=_jump_ahead).run()
    kinds = {v.kind for v in res.violations}
    assert {"mirror_ahead", "mirror_ahead_of_heard"} <= kinds, res.summary()


def test_the_untampered_runs_pass() -> None:
    res = Simulation(3, 300, knobs=Busy).run()
    assert res.ok, res.summary()
    assert res.stats["mirror"]["events"] > 0


def test_mirror_checks_catch_backwards_and_ahead() -> None:
    seen: list[str] = []
    checks = MirrorChecks(lambda kind, _detail: seen.append(kind))
    checks.position(10, 10, 12)
    assert seen == []
    checks.position(9, 10, 12)
    assert seen == ["mirror_backwards"]
    checks.position(13, 13, 12)
    assert seen[-1] == "mirror_ahead"
    checks.position(12, 11, 12)
    assert seen[-1] == "mirror_ahead_of_heard"


def _raft_lines(trace: list[str]) -> list[str]:
    return [ln for ln in trace if "mirror" not in ln and " end {" not in ln]


def test_the_mirror_leaves_the_raft_run_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression seeds of test_raft_sim.py keep their meaning only if a seed's
    replicas do the same with the mirror as without it."""
    with_mirror = Simulation(6, 400).run()
    monkeypatch.setattr(SimMirror, "attach", lambda *_: None)
    monkeypatch.setattr(SimMirror, "step", lambda *_, **__: None)
    without = Simulation(6, 400).run()
    assert _raft_lines(with_mirror.trace) == _raft_lines(without.trace)
    assert with_mirror.stats["mirror"]["events"] > 0 and without.stats["mirror"]["events"] == 0
