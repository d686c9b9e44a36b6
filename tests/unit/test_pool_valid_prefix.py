"""`valid_prefix` (vectorized header validation) against the header-by-header rule."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.agent.pool import ALLOCATED, FREE, HEADER_BYTES, STORED, read_header, valid_prefix

_HDR = struct.Struct("<QBB6x32s16x")


def reference(headers: bytes, hashes: list[bytes], gens: list[int]) -> int:
    for i, (hh, g) in enumerate(zip(hashes, gens, strict=True)):
        h = read_header(headers, i * HEADER_BYTES)
        if h.state != STORED or h.generation != g or h.block_hash != hh:
            return i
    return len(hashes)


block = st.tuples(
    st.binary(min_size=1, max_size=32),  # hash
    st.integers(0, 2**64 - 1),  # generation announced
    st.sampled_from(["ok", "gen", "state", "hash", "len"]),  # what the holder did
)


@settings(max_examples=200, deadline=None)
@given(st.lists(block, max_size=20))
def test_matches_the_header_by_header_rule(blocks: list[tuple[bytes, int, str]]) -> None:
    headers, hashes, gens = b"", [], []
    for hh, g, fate in blocks:
        state, gen, stored = STORED, g, hh
        if fate == "gen":
            gen = (g + 1) % 2**64
        elif fate == "state":
            state = FREE if g % 2 else ALLOCATED
        elif fate == "hash":
            stored = bytes([hh[0] ^ 1]) + hh[1:]
        elif fate == "len" and len(hh) < 32:
            stored = hh + b"\0"  # a longer hash that only differs by padding
        headers += _HDR.pack(gen, state, len(stored), stored)
        hashes.append(hh)
        gens.append(g)
    assert valid_prefix(headers, hashes, gens) == reference(headers, hashes, gens)


def test_refuses_mismatched_input() -> None:
    with pytest.raises(ValueError, match="generations"):
        valid_prefix(bytes(HEADER_BYTES), [b"a"], [])
    with pytest.raises(ValueError, match="headers"):
        valid_prefix(b"", [b"a"], [1])
    assert valid_prefix(b"", [], []) == 0
