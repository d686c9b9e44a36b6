"""Hostile KV-event payloads (what a broken or malicious engine could publish).

Families: random bytes; CBOR and msgpack of arbitrary nested values;
arrays and maps nested up to 100k deep; well-shaped batches whose events
carry values of the wrong types; real-looking batches with bytes mutated.
"""

from __future__ import annotations

from typing import Any

import cbor2
import msgpack  # type: ignore[import-untyped]
from hypothesis import strategies as st

from bench.fuzz.cases import mutated

DEPTHS = (10, 100, 1000, 10_000, 100_000)
TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "", "blockstored", 0, None)

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=16),
    st.binary(max_size=40),
)
values: st.SearchStrategy[Any] = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=40,
)


def _deep_array(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of one, `depth` times, around nil


def _deep_map(depth: int) -> bytes:
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ...}}


def _packb(obj: Any) -> bytes:
    try:
        out: bytes = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"  # the one byte msgpack never uses
    return out


def _event(tag: Any, fields: list[Any], as_map: bool) -> Any:
    if as_map:
        keys = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]
        return {"type": tag, **dict(zip(keys, fields, strict=False))}
    return [tag, *fields]


_events = st.builds(_event, st.sampled_from(TAGS), st.lists(values, max_size=8), st.booleans())
_batches = st.builds(
    lambda ts, events, rank, n: _packb([ts, events, rank][:n]),
    st.one_of(st.floats(), st.integers(), values),
    st.lists(_events, max_size=6),
    st.one_of(st.none(), st.integers(-2, 2**40), values),
    st.integers(1, 4),
)
_real = st.just(_packb([1.5, [["BlockStored", [1, 2], None, list(range(32)), 16, None]], 0]))


def event_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=1024),
        values.map(_packb),
        values.map(cbor2.dumps),
        st.sampled_from(DEPTHS).map(_deep_array),
        st.sampled_from(DEPTHS).map(_deep_map),
        _batches,
        mutated(st.one_of(_batches, _real)),
    )
