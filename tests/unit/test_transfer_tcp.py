"""The tcp backend's pure pieces: request framing and batch splitting (no sockets here;
the agent tier reads over real connections)."""

from __future__ import annotations

import struct
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.transfer import tcp
from kvdir.transfer.base import Read

Pair = tuple[int, int, int]


def byte_pairs(reads: list[Read]) -> Counter[Pair]:
    out: Counter[Pair] = Counter()
    for r in reads:
        for k in range(r.length):
            out[(r.rkey, r.remote_address + k, r.dst_offset + k)] += 1
    return out


def test_request_framing() -> None:
    batch = [Read(0x1000, 7, 64, 0), Read(0xFFFF_FFFF_0000, 0xDEAD_BEEF, 1, 64)]
    raw = tcp._request(42, batch)
    head = struct.unpack_from("<4sBBHIQ", raw)
    assert head == (b"KVDT", tcp.VERSION, tcp.OP_READ, 0, 2, 42)
    segs = list(struct.iter_unpack("<QII", raw[20:]))
    assert segs == [(0x1000, 7, 64), (0xFFFF_FFFF_0000, 0xDEAD_BEEF, 1)]
    assert len(raw) == 20 + 2 * 16


@settings(max_examples=300, deadline=None)
@given(
    reads=st.lists(
        st.builds(
            Read,
            remote_address=st.integers(0, 1 << 20),
            rkey=st.integers(1, 3),
            length=st.integers(1, 300),
            dst_offset=st.integers(0, 1 << 20),
        ),
        max_size=30,
    ),
    segs_max=st.integers(1, 5),
    bytes_max=st.integers(1, 256),
)
def test_split_respects_the_caps_and_moves_the_same_bytes(
    reads: list[Read], segs_max: int, bytes_max: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tcp, "SEGMENTS_PER_REQUEST_MAX", segs_max)
        mp.setattr(tcp, "REQUEST_BYTES_MAX", bytes_max)
        batches = tcp._split(reads)
    flat = [r for b in batches for r in b]
    assert byte_pairs(flat) == byte_pairs(reads)
    for b in batches:
        assert 0 < len(b) <= segs_max
        assert sum(r.length for r in b) <= bytes_max
        assert all(r.length > 0 for r in b)


def test_split_of_nothing_is_no_request() -> None:
    assert tcp._split([]) == []


def test_split_keeps_a_small_batch_whole() -> None:
    reads = [Read(i * 100, 1, 10, i * 10) for i in range(5)]
    assert tcp._split(reads) == [reads]
