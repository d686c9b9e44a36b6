"""Decoding every KV-event wire format, hash normalisation, sequencing, fuzz (no sockets)."""

from __future__ import annotations

import contextlib
import hashlib

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.agent.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    decode_seq,
)
from kvdir.agent.events.hashes import HashFormat, int64_of_digest, key, keys, u64_of_digest
from kvdir.agent.events.selfcheck import block_digests, check_event, first_block_hashes
from kvdir.agent.events.sequence import Sequencer, Step

BIG = (1 << 64) - 5  # a uint64 >= 2^63


def pack(obj: object) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def test_vllm_0_9_batch_without_rank_and_short_positional_events() -> None:
    b = decode_batch(pack([1.5, [["BlockStored", [1, BIG], None, list(range(32)), 16, None]]]))
    assert b.dp_rank is None and b.bad_events == 0
    ev = b.events[0]
    assert isinstance(ev, BlockStored) and ev.hashes == [1, BIG] and ev.medium is None


def test_vllm_0_23_positional_with_every_field() -> None:
    stored = ["BlockStored", [7], 3, list(range(16)), 16, None, "CPU", "lora-a", [None], 0, "x", 0]
    removed = ["BlockRemoved", [7], "CPU", 0]
    b = decode_batch(pack([2.0, [stored, removed, ["AllBlocksCleared"]], 1]))
    s, r, c = b.events
    assert isinstance(s, BlockStored) and (s.medium, s.lora_name, s.group_idx) == (
        "CPU",
        "lora-a",
        0,
    )
    assert isinstance(r, BlockRemoved) and r.medium == "CPU" and r.group_idx == 0
    assert isinstance(c, AllBlocksCleared) and b.dp_rank == 1


def test_vllm_0_24_plus_maps_ignore_unknown_fields() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "locality": "LOCAL",
        "session_id": "s",
        "lookahead_token_ids": [[1]],
        "something_from_0_99": {"x": 1},
    }
    b = decode_batch(pack([3.0, [stored, {"type": "BlockRemoved", "block_hashes": [BIG]}], 0]))
    s, r = b.events
    assert isinstance(s, BlockStored) and s.hashes == [b"\x01" * 32] and s.medium == "GPU"
    assert isinstance(r, BlockRemoved) and r.medium is None


def test_sglang_batch_with_nil_rank_and_signed_hashes() -> None:
    digest = hashlib.sha256(b"sglang").digest()
    h = int64_of_digest(digest)
    b = decode_batch(
        pack([4.0, [["BlockStored", [h], None, list(range(16)), 16, None, "CPU_TIER2"]], None])
    )
    ev = b.events[0]
    assert isinstance(ev, BlockStored) and ev.medium == "CPU_TIER2"
    assert key(h) == digest[:8], "SGLang's int64 keys as the digest's first 8 bytes"


def test_a_bad_event_is_skipped_and_counted() -> None:
    b = decode_batch(
        pack([1.0, [["Bogus"], ["BlockStored", "x", None, [], 16, None], ["AllBlocksCleared"]]])
    )
    assert b.bad_events == 2 and len(b.events) == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        pack({"a": 1}),
        pack([1.0]),
        pack(["t", []]),
        pack([1.0, [], -1]),
        pack([1.0, {}]),
    ],
)
def test_malformed_batches_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_seq_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(b"\xff" * 8) == -1
    with pytest.raises(DecodeError):
        decode_seq(b"\x00")


def test_hash_forms() -> None:
    digest = hashlib.sha256(b"x").digest()
    assert keys([u64_of_digest(digest)]) == [digest[-8:]]
    assert keys([BIG], HashFormat.U64) == [BIG.to_bytes(8, "big")]
    assert keys([-1]) == [b"\xff" * 8] == keys([(1 << 64) - 1])
    assert keys([digest], HashFormat.BYTES) == [digest]
    for bad, fmt in (
        ([-1], HashFormat.U64),
        ([1 << 63], HashFormat.SIGNED),
        ([1 << 64], HashFormat.AUTO),
        ([1], HashFormat.BYTES),
        ([b"x" * 33], HashFormat.AUTO),
        ([b""], HashFormat.AUTO),
        ([1, b"x"], HashFormat.AUTO),
        ([True], HashFormat.AUTO),
    ):
        with pytest.raises(DecodeError):
            keys(bad, fmt)  # type: ignore[arg-type]


def test_selfcheck_matches_published_and_diagnoses() -> None:
    toks = list(range(48))
    ints = first_block_hashes(toks, 16, "sha256_cbor", "")
    ev = BlockStored(ints, None, toks, 16)
    ok = check_event(ev, "sha256_cbor", "", 16)
    assert ok is not None and ok.ok and ok.blocks == 3
    bad = check_event(ev, "sha256", "", 16)
    assert bad is not None and not bad.ok and "They match sha256_cbor" in bad.message
    size = check_event(ev, "sha256_cbor", "", 32)
    assert size is not None and not size.ok and "block size" in size.message
    as_bytes = BlockStored(list(block_digests(toks, 16, "sha256")), None, toks, 16)
    assert (r := check_event(as_bytes, "sha256", "", 16)) is not None and r.ok


def test_sequencer_steps() -> None:
    s = Sequencer()
    assert s.observe(3) is Step.FIRST and s.missing_from(3) == 0
    s.applied(3)
    assert s.observe(4) is Step.IN_ORDER
    assert s.observe(9) is Step.GAP and s.missing_from(9) == 4
    assert s.accept_replayed(5, 9) and not s.accept_replayed(9, 9)
    assert s.observe(0) is Step.RESTART


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200) | _msgpack_values.map(pack))
def test_fuzz_decode_never_raises_anything_but_decode_error(payload: bytes) -> None:
    try:
        b = decode_batch(payload)
    except DecodeError:
        return
    for ev in b.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            with contextlib.suppress(DecodeError):
                keys(ev.hashes)
