"""The replay's per-node LRU: prefixes outlive their extensions."""

from __future__ import annotations

from kvdir.replay.cache import NodeCache


def test_prefix_counts_leading_cached_blocks() -> None:
    c = NodeCache(10)
    c.insert([1, 2, 3], [10, 11, 12])
    assert c.prefix([1, 2, 3, 4]) == 3
    assert c.prefix([1, 9, 3]) == 1
    assert c.prefix([7, 1]) == 0
    assert c.slot(2) == 11 and 3 in c and len(c) == 3


def test_make_room_evicts_least_recent_suffix_first() -> None:
    c = NodeCache(5)
    c.insert([1, 2, 3], [0, 1, 2])
    c.touch([1, 2, 3])  # chain used: 3, then 2, then 1 -> 1 most recent
    c.insert([8, 9], [3, 4])
    c.touch([8, 9])
    assert c.make_room(2) == [(3, 2), (2, 1)]  # the suffix of the older chain goes first
    assert c.prefix([1, 2, 3]) == 1
    assert c.prefix([8, 9]) == 2
    assert len(c) == 3


def test_touch_protects_a_chain_in_use() -> None:
    c = NodeCache(4)
    c.insert([1, 2], [0, 1])
    c.insert([5, 6], [2, 3])
    c.touch([1, 2])
    assert [b for b, _ in c.make_room(2)] == [5, 6]
    assert c.prefix([1, 2]) == 2


def test_make_room_never_goes_below_empty() -> None:
    c = NodeCache(2)
    c.insert([1, 2], [0, 1])
    assert len(c.make_room(5)) == 2
    assert len(c) == 0
