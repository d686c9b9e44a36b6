"""transfer.base: read coalescing, destination checks and regions (pure logic)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvdir.transfer.base import Read, Region, block_reads, check_destination, coalesce

Pair = tuple[int, int, int]
"""(rkey, remote byte address, local byte offset) of one byte a read moves."""


def byte_pairs(reads: list[Read]) -> Counter[Pair]:
    """Every byte the reads move, as a multiset (a read listed twice moves its bytes twice)."""
    out: Counter[Pair] = Counter()
    for r in reads:
        for k in range(r.length):
            out[(r.rkey, r.remote_address + k, r.dst_offset + k)] += 1
    return out


_READS = st.lists(
    st.builds(
        Read,
        remote_address=st.integers(0, 96),
        rkey=st.sampled_from([1, 2]),
        length=st.integers(1, 16),
        dst_offset=st.integers(0, 96),
    ),
    max_size=24,
)


@settings(max_examples=500, deadline=None)
@given(reads=_READS, limit=st.integers(1, 64))
@example(reads=[Read(0, 1, 4, 0), Read(0, 1, 4, 100), Read(4, 1, 4, 104)], limit=64)
@example(reads=[Read(4, 1, 4, 4), Read(0, 1, 4, 0)], limit=8)
def test_coalesced_reads_move_exactly_the_same_bytes(reads: list[Read], limit: int) -> None:
    if any(r.length > limit for r in reads):
        limit = max(r.length for r in reads)  # coalesce never splits, it only merges
    merged = coalesce(reads, limit)
    assert byte_pairs(merged) == byte_pairs(reads)
    assert len(merged) <= len(reads)
    assert all(0 < m.length <= limit for m in merged)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 40),
    size=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
    gap=st.booleans(),
)
def test_contiguous_blocks_in_any_order_merge(n: int, size: int, seed: int, gap: bool) -> None:
    """Blocks contiguous on both sides become one read, whatever order they are asked in;
    one gap on the local side splits them into exactly two."""
    reads = [
        Read(1000 + i * size, 7, size, i * size + (5 if gap and i >= n // 2 else 0))
        for i in range(n)
    ]
    random.Random(seed).shuffle(reads)
    merged = coalesce(reads)
    expect = 2 if gap and 0 < n // 2 < n else 1
    assert len(merged) == expect
    assert sum(m.length for m in merged) == n * size
    assert byte_pairs(merged) == byte_pairs(reads)


def _columns(reads: list[Read]) -> tuple[list[int], list[int], list[int], list[int]]:
    return (
        [r.remote_address for r in reads],
        [r.rkey for r in reads],
        [r.length for r in reads],
        [r.dst_offset for r in reads],
    )


@settings(max_examples=500, deadline=None)
@given(reads=_READS, limit=st.integers(1, 64), runs=st.booleans())
@example(reads=[Read(0, 1, 4, 0), Read(4, 1, 4, 4), Read(8, 2, 4, 8)], limit=64, runs=False)
def test_block_reads_move_exactly_the_blocks_bytes(
    reads: list[Read], limit: int, runs: bool
) -> None:
    """What a fetch hands a channel: the same bytes as one read per block, its runs
    already merged in order (never across rkeys or gaps, never past the limit)."""
    if runs:  # a fetch's usual shape: blocks that follow each other on both sides
        reads = [Read(50 + 8 * i, 1, 8, 8 * i) for i in range(len(reads))] + reads
    limit = max([limit, *(r.length for r in reads)])
    got = block_reads(*_columns(reads), limit=limit)
    assert byte_pairs(got) == byte_pairs(reads)
    assert len(got) <= len(reads)
    assert all(0 < g.length <= limit for g in got)
    assert byte_pairs(coalesce(got, limit)) == byte_pairs(reads)


def test_block_reads_merge_a_run_in_order_and_split_it_at_the_limit() -> None:
    run = [Read(1000 + 10 * i, 3, 10, 10 * i) for i in range(10)]
    assert block_reads(*_columns(run)) == [Read(1000, 3, 100, 0)]
    assert [r.length for r in block_reads(*_columns(run), limit=30)] == [30, 30, 30, 10]
    gap = [*run[:5], Read(2000, 3, 10, 50), *run[6:]]
    assert [(r.remote_address, r.length) for r in block_reads(*_columns(gap))] == [
        (1000, 50), (2000, 10), (1060, 40)
    ]  # fmt: skip
    assert block_reads([], [], [], []) == []
    with pytest.raises(ValueError, match="2 addresses, 1 rkeys"):
        block_reads([0, 1], [1], [1, 1], [0, 1])


def test_coalesce_respects_the_segment_limit() -> None:
    reads = [Read(i * 10, 1, 10, i * 10) for i in range(10)]
    merged = coalesce(reads, limit=30)
    assert [m.length for m in merged] == [30, 30, 30, 10]
    assert byte_pairs(merged) == byte_pairs(reads)


def test_coalesce_keeps_rkeys_apart() -> None:
    reads = [Read(0, 1, 8, 0), Read(8, 2, 8, 8)]
    assert coalesce(reads) == sorted(reads, key=lambda r: r.rkey)


def test_coalesce_of_nothing_is_nothing() -> None:
    assert coalesce([]) == []


@pytest.mark.parametrize(
    "read",
    [Read(0, 1, 0, 0), Read(0, 1, -1, 0), Read(0, 1, 4, -1), Read(0, 1, 4, 61), Read(0, 1, 65, 0)],
)
def test_check_destination_refuses_reads_outside_dst(read: Read) -> None:
    with pytest.raises(ValueError, match="does not fit a 64-byte destination"):
        check_destination([Read(0, 1, 64, 0), read], 64)


def test_check_destination_accepts_an_exact_fit() -> None:
    check_destination([Read(0, 1, 64, 0), Read(0, 1, 1, 63)], 64)


@pytest.mark.parametrize(
    ("address", "length", "inside"),
    [
        (100, 50, True),
        (100, 1, True),
        (149, 1, True),
        (99, 1, False),
        (149, 2, False),
        (150, 1, False),
        (0, 1 << 64, False),
    ],
)
def test_region_contains(address: int, length: int, inside: bool) -> None:
    assert Region(100, 50, 9).contains(address, length) is inside
