"""The shard map refresher (directory/shard_service.py) on an injected clock
and an in-memory source: bounded steps, versions only up, the loop's period,
a wake-up, and its end."""

from __future__ import annotations

import threading

from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.directory.shard_service import NO_MAP_INTERVAL_S, MapRefresher
from kvdir.directory.shard_view import ShardView

MAP = even_map([Group("g0", ("127.0.0.1:1",)), Group("g1", ("127.0.0.1:2",))])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Source:
    """What the home group would answer; counts the asks."""

    def __init__(self) -> None:
        self.map: ShardMap | None = None
        self.asks: list[int] = []
        self.asked = threading.Event()

    def __call__(self, min_version: int, timeout_s: float) -> ShardMap | None:
        assert timeout_s >= 0
        self.asks.append(min_version)
        self.asked.set()
        return self.map


def test_steps_take_newer_maps_only_and_count_failures() -> None:
    view, source, clock = ShardView("g1", sharded=True), Source(), Clock()
    r = MapRefresher(view, source, interval_s=1.0, clock=clock)
    assert r.due_in() == 0.0
    assert not r.step() and r.failures == 1 and view.shard_map is None
    assert abs(r.due_in() - NO_MAP_INTERVAL_S) < 1e-9  # no map yet: ask again soon
    source.map = MAP
    assert r.step() and r.failures == 0 and view.version == 1
    assert not r.step()  # the same version again changes nothing
    assert source.asks == [0, 0, 1]
    clock.now += 0.4
    assert abs(r.due_in() - 0.6) < 1e-9  # with a map: one period
    clock.now += 5
    assert r.due_in() == 0.0
    source.map = MAP.with_split(0, 9)
    assert r.step() and view.version == 2
    source.map = MAP  # an older answer (a lagging home replica) is ignored
    assert not r.step() and view.version == 2


def test_a_failing_source_is_a_failed_step_not_a_dead_thread() -> None:
    view = ShardView("g1", sharded=True)

    def broken(_v: int, _t: float) -> ShardMap | None:
        raise RuntimeError("home unreachable")

    r = MapRefresher(view, broken, interval_s=1.0, clock=Clock())
    assert not r.step() and r.failures == 1


def test_the_loop_wakes_on_demand_and_ends_with_stop() -> None:
    view, source = ShardView("g1", sharded=True), Source()
    source.map = MAP
    r = MapRefresher(view, source, interval_s=3600.0)  # the real clock: only wakes refresh
    t = threading.Thread(target=r.run)
    t.start()
    try:
        assert source.asked.wait(10)  # the first step is due at once
        source.asked.clear()
        source.map = MAP.with_split(0, 9)
        r.wake()
        assert source.asked.wait(10)
    finally:
        r.stop()
        t.join(10)
    assert not t.is_alive()
    assert len(source.asks) == 2
    # The wake's step may still be offering when `asked` fires; it has once the thread ended.
    assert view.version == 2
