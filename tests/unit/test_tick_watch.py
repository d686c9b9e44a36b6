"""`TickWatch`: the Raft thread's tick gaps past a threshold, and their fdatasync share."""

from __future__ import annotations

from kvdir.directory.consensus.stall import Stall, TickWatch


def test_only_gaps_past_the_threshold_are_stalls() -> None:
    w = TickWatch(0.075)
    assert w.tick(10.0, 1.0) is None  # the first tick has no gap
    assert w.tick(10.010, 1.0) is None
    assert w.tick(10.080, 1.0) is None  # 70 ms: under it
    stall = w.tick(10.395, 1.25)
    assert stall is not None
    assert abs(stall.gap_s - 0.315) < 1e-9
    assert abs(stall.fdatasync_s - 0.25) < 1e-9
    assert w.stalls == 1
    assert abs(w.longest_s - 0.315) < 1e-9


def test_the_fdatasync_share_is_of_this_gap_only() -> None:
    w = TickWatch(0.05)
    w.tick(0.0, 0.0)
    w.tick(0.01, 0.5)  # half a second of syncs counted before: not this gap's
    stall = w.tick(0.2, 0.6)
    assert isinstance(stall, Stall)
    assert abs(stall.gap_s - 0.19) < 1e-9
    assert abs(stall.fdatasync_s - 0.1) < 1e-9
