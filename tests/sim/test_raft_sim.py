"""The seeded simulator of the real replicas (bench/sim; issue 29).

Real `_replica.Replica`s (pysyncobj with kvdir's fixes, kvdir's journal, the
table) on a simulated clock, network and disk. Each seed runs
`STEPS` steps of 10 ms with faults, then heals and checks the history.
A failure prints the seed, its violations and the end of its trace; replay
one with `kvdir sim --seed S --seeds 1 --steps 1000 --trace`.

KVDIR_RAFT_SIM_SEEDS sets the number of seeds (default 100: about a minute on
one core of the 2-core CI machine, measured with `kvdir sim`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from bench.sim.disk import Disk
from bench.sim.net import NetFaults
from bench.sim.simulation import Knobs, Simulation, run_seed
from kvdir.directory.consensus._replica import Replica

pytestmark = pytest.mark.filterwarnings(
    # pysyncobj's Serializer drops the file it sends a snapshot from without closing it
    # (a finished or cancelled transmission is popped from a dict); CPython closes it
    # as it is released, with a ResourceWarning. Not ours to fix, and not a leak.
    "ignore::pytest.PytestUnraisableExceptionWarning",
    "ignore::ResourceWarning",
)

SEEDS = int(os.environ.get("KVDIR_RAFT_SIM_SEEDS", "100"))
STEPS = 1000
SAFETY = {
    "two_leaders",
    "committed_entry_differs",
    "digest_differs",
    "lost_write",
    "not_linearizable",
}
"""Violations that mean a wrong answer or a lost write (the others break a rule that
leads there, or liveness)."""


@pytest.mark.parametrize("seed", range(1, SEEDS + 1), ids=lambda s: f"seed_{s}")
def test_seed(seed: int) -> None:
    res = run_seed(seed, STEPS)
    assert res.ok, res.summary()
    assert res.stats["ops"] > 0 or res.stats["terms"] == 0, res.summary()


REGRESSION_SEEDS = {
    (4, STEPS): "hole 1: a follower cut entries matching the committed ones",
    (47, STEPS): "hole 1: ... below its own commit index",
    (25, STEPS): "hole 3: a large entry's early 'finish' chunk failed to unpickle (EOFError)",
    (91, STEPS): "hole 3: the same",
    (36, STEPS): (
        "hole 1, and a snapshot chunk raised a follower's commit index over a deposed "
        "leader's entries: it applied them, an acknowledged Publish was lost, tables differed"
    ),
    (317, 2000): (
        "membership rebuilt from snapshots after restarts: members disagreed on who votes, "
        "a leader's configuration left out the replica holding 20 acknowledged writes"
    ),
    (8291, 2000): (
        "a dump kept a membership change past its anchor that was cut later: after a "
        "restart a replica left out a member that still voted, two leaders in term 12"
    ),
    (2797, 2000): (
        "a duplicate snapshot from the leader, older than the follower's own dump, replaced "
        "it; at the restart the journal was dropped and a stale leader overwrote committed entries"
    ),
    (8019, 2000): (
        "a removed replica left running (no leader, applying nothing) kept the mirror on "
        "it with heartbeats, 68 entries behind the healed cluster (now cut off: no-leader)"
    ),
    (6868, 2000): "the same, 16 entries behind",
    (7205, 2000): (
        "a follower numbered its forwarded commands from 0 in every run: a peer's answer to "
        "its previous run's command took this run's (a Remove acknowledged with a Publish's "
        "result)"
    ),
    (6296, 2000): (
        "the same: a NOT_LEADER meant for the previous run's command failed a write that "
        "then committed"
    ),
    (31, STEPS): (
        "a write a follower forwarded to the leader late (queued while the client's attempt "
        "timed out) landed after the client's retry and its next write: an acknowledged "
        "remove undone (the chaos run of bench/results/chaos-2026-12-04-violation.md)"
    ),
    (125, STEPS): "the same",
    (167, STEPS): "the same",
    (3427, 2000): (
        "stuck (no write lost): a replica added back, whose only dump predated its "
        "re-addition, sent it as leader to a follower just added back, which took its "
        "membership (without the leader), refused the leader's link and never heard again"
    ),
}
"""(seed, steps) that failed before a fix of issue 29 and pass after: the first five on
f4a7c8a's directory/ (before bf97ea0 and be749fc; all 100 CI seeds' results are in
bench/results/raft-sim-2026-12-03.md), 317 on 3cca776's (before 80e4bd4), the 2026-12-04
ones on 120b00d's (bench/results/raft-sim-long-2026-12-04.md) and 3427 on 79304ed's (the
rerun, bench/results/raft-sim-long-2026-12-04-rerun.md), each run with this simulator;
31, 125 and 167 with clients that retry (`workload`), on this commit with writes forwarded
again (`test_the_checks_catch_a_write_forwarded_late`). Replicas no longer forward writes,
which re-rolled every seed: the older ones pass, but may no longer take their old path.
A change to the simulator re-rolls what a seed does: re-derive this list the same way then."""


@pytest.mark.parametrize(
    ("seed", "steps"),
    sorted(REGRESSION_SEEDS),
    ids=[f"regression_{seed}_{steps}" for seed, steps in sorted(REGRESSION_SEEDS)],
)
def test_regression_seed(seed: int, steps: int) -> None:
    res = run_seed(seed, steps)
    assert res.ok, f"{REGRESSION_SEEDS[(seed, steps)]}\n{res.summary()}"


def test_members_agree_after_a_blackout_that_follows_membership_changes() -> None:
    """Found by the simulator: at a restart pysyncobj took the membership from the
    snapshot and replayed later membership entries only as it applied them (up to
    the commit index it had stored); after a follower was removed and another added
    back, a power cut of every replica left the members with different memberships
    and no leader was ever elected. A replica now replays every membership change
    in its log at its first tick (`DurableSyncObj._onTick`)."""
    knobs = dataclasses.replace(Knobs.draw(random.Random("sim/11")), membership=0.01)
    res = Simulation(11, 1000, knobs=knobs).run()
    assert res.ok, res.summary()


def test_a_seed_replays_identically() -> None:
    first, second = run_seed(6, 400), run_seed(6, 400)
    assert first.trace == second.trace
    assert [str(v) for v in first.violations] == [str(v) for v in second.violations]
    assert len(first.trace) > 50  # it did something worth replaying
    assert run_seed(7, 400).trace != first.trace


_TRACE_DIGEST = (
    "import hashlib; from bench.sim.simulation import run_seed; "
    "print(hashlib.sha256(chr(10).join(run_seed(5, 300).trace).encode()).hexdigest())"
)


def test_a_seed_replays_identically_in_another_process() -> None:
    """String hashing differs per process (PYTHONHASHSEED); the run must not."""
    digests = {
        subprocess.run(
            [sys.executable, "-c", _TRACE_DIGEST],
            env={**os.environ, "PYTHONHASHSEED": str(h)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
        for h in (1, 2)
    }
    assert len(digests) == 1, digests


def test_the_checks_catch_a_write_forwarded_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas as they were before the fix: any replica takes a write and pysyncobj
    forwards it to the leader (holding it while it knows of none). With clients that
    retry, seed 31 then shows an acknowledged write undone."""

    def forwarding(self: Replica, blob: bytes, callback: Any, may_forward: bool = False) -> None:
        self._apply_blob(blob, callback=callback)

    monkeypatch.setattr(Replica, "propose_blob", forwarding)
    res = run_seed(31, STEPS)
    assert {v.kind for v in res.violations} & SAFETY, res.summary()


PowerCuts = Knobs(
    net=NetFaults(),
    crash=0.0,
    power_loss=1.0,
    blackout=0.01,
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


def test_the_checks_catch_a_disk_that_loses_synced_writes() -> None:
    """With syncs recorded as nothing, a power cut of every replica wipes the cluster:
    acknowledged writes are gone, and some seed must show it."""
    caught = set()
    for seed in range(1, 11):
        res = Simulation(seed, 600, knobs=PowerCuts, disk_lies=True).run()
        caught |= {v.kind for v in res.violations} & SAFETY
    assert caught, "ten seeds of power cuts on a lying disk went unnoticed"


def test_power_loss_keeps_synced_bytes_and_a_prefix_of_the_rest(tmp_path: str) -> None:
    d = Disk(str(tmp_path))
    log = os.path.join(d.dir, "log")
    fd = os.open(log, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"synced")
    d.sync_file(fd)
    d.sync_dir(d.dir)
    os.write(fd, b"-tail")
    os.close(fd)
    with open(os.path.join(d.dir, "new"), "wb") as f:
        f.write(b"never synced")
    tmp = os.path.join(d.dir, "renamed.tmp")
    with open(tmp, "wb") as f:
        f.write(b"synced, renamed, directory not synced")
        f.flush()
        d.sync_file(f.fileno())
    os.replace(tmp, os.path.join(d.dir, "renamed"))
    lost = d.power_loss(random.Random(1))
    assert sorted(lost) == ["new", "renamed"]
    with open(log, "rb") as f:
        kept = f.read()
    assert kept.startswith(b"synced") and b"synced-tail".startswith(kept)
    assert sorted(n for n in os.listdir(d.dir) if not n.startswith(".")) == ["log"]


def test_the_command_runs_seeds_and_says_how_fast(capsys: pytest.CaptureFixture[str]) -> None:
    from kvdir.cli import main

    assert main(["sim", "--seeds", "2", "--steps", "150", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 seeds" in out and "steps/s" in out and "failed: 0" in out
