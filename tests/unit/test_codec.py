"""Round trips of every command through the byte codec, and malformed input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvdir.core.shard_map import Group, even_map
from kvdir.core.wire import HASH_BYTES_MAX
from kvdir.directory import codec
from kvdir.directory.codec import MAGIC, VERSION, VERSIONS_READ, CodecError, decode, encode
from kvdir.directory.commands import (
    Barrier,
    BeginImport,
    ClearNode,
    Command,
    DropShard,
    ExpireNodes,
    FreezeShard,
    Heartbeat,
    Import,
    ImportDone,
    Publish,
    RegisterNode,
    Remove,
    SetShardMap,
)

U32 = 2**32 - 1
U64 = 2**64 - 1

H8 = [bytes([i]) * 8 for i in range(4)]
H32 = [bytes([0xA0 + i]) * 32 for i in range(3)]
MIXED = [b"\x01", H8[0], H32[0], b"\x02" * 17, H8[1]]

EXAMPLES: list[Command] = [
    RegisterNode("node-1", "host-1", "10.0.0.1:5000", ("rdma", "tcp"), 1, 10_000, 123),
    RegisterNode("", "", "", (), 0, 0, 0),
    RegisterNode("ノード-ü-🚀", "hôst", "[::1]:1", ("ucx",) * 8, U64, U32, U64),
    Heartbeat("node-1", 7, 1_700_000_000_000),
    Heartbeat("ß", U64, 0),
    Publish("n", 1, "ns", 1, H8, [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 1, 2, U64]),
    Publish("n", 2, "ns\x1fbf16", 2, H32, [U64] * 3, [U32] * 3, [U32] * 3, [U64] * 3),
    Publish("n", 3, "ns", 1, MIXED, [1] * 5, [2] * 5, [3] * 5, [4] * 5),
    Publish("n", 3, "ns", 255, [b"\xff" * HASH_BYTES_MAX], [0], [0], [0], [0]),
    Remove("n", 1, "ns", 1, H8),
    Remove("n", 1, "ns", 2, H32, [1, 2, 3]),
    Remove("n", 1, "ns", 1, MIXED, [U64, 0, 1, 2, 3]),
    Remove("n", 1, "ns", 1, H8[:2], [], [U64, 0]),
    Remove("n", 1, "ns", 2, H32[:2], [5, 6], [7, 8]),
    ClearNode("n", 1, None, False),
    ClearNode("n", 1, None, True),
    ClearNode("n", 1, "ns", False),
    ClearNode("n", 1, "", True),
    ExpireNodes(0, ()),
    ExpireNodes(U64, (("a", 1), ("ü", U64), ("", 0))),
    Barrier(),
    SetShardMap(0, even_map([Group("g0", ("127.0.0.1:1",))])),
    SetShardMap(U64 - 1, even_map([Group("g0", ("a:1", "b:2")), Group("ü", ("c:3",))], 3)),
    FreezeShard(0, 0, 2**64),
    BeginImport(U32, U64 - 1, U64),
    Import(7, Publish("n", 1, "ns", 1, H8, [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0] * 4)),
    Import(7, Remove("n", 1, "ns", 2, H32[:2], [5, 6], [7, 8])),
    Import(0, ClearNode("n", 1, None, True)),
    Import(0, ExpireNodes(U64, (("a", 1),))),
    ImportDone(U32),
    DropShard(3, 255),
]

EMPTY_BATCHES: list[Command] = [
    Publish("n", 1, "ns", 1, [], [], [], [], []),
    Remove("n", 1, "ns", 1, []),
    Remove("n", 1, "ns", 2, [], [], []),
]


def ids(cmds: list[Command]) -> list[str]:
    return [f"{i}-{type(c).__name__}" for i, c in enumerate(cmds)]


@pytest.mark.parametrize("cmd", EXAMPLES, ids=ids(EXAMPLES))
def test_roundtrip_examples(cmd: Command) -> None:
    blob = encode(cmd)
    assert blob[:1] == MAGIC and blob[1] in VERSIONS_READ
    # A command keeps the oldest format version that has its type (codec._SINCE).
    new = (SetShardMap, FreezeShard, BeginImport, Import, ImportDone, DropShard)
    assert blob[1] == (VERSION if isinstance(cmd, new) else 2)
    got = decode(blob)
    assert got == cmd
    assert type(got) is type(cmd)
    assert encode(got) == blob


@pytest.mark.parametrize("cmd", EMPTY_BATCHES, ids=ids(EMPTY_BATCHES))
def test_roundtrip_empty_batches(cmd: Command) -> None:
    """encode() writes an empty hash batch as mode 0 with width 0; decode() then
    steps `range(0, 0, 0)` and raises a bare ValueError instead of returning []."""
    assert decode(encode(cmd)) == cmd


def test_command_types_are_distinct_bytes() -> None:
    kinds = {encode(c)[2] for c in EXAMPLES}
    assert len(kinds) == 13


def test_same_width_hashes_use_compact_mode() -> None:
    same = encode(Remove("n", 1, "ns", 1, H8))
    mixed = encode(Remove("n", 1, "ns", 1, [H8[0], H8[1] + b"\x00"]))
    # mode 0 stores one width; mode 1 stores one per hash.
    assert len(same) == len(encode(Remove("n", 1, "ns", 1, []))) + 8 * len(H8)
    assert len(mixed) > len(encode(Remove("n", 1, "ns", 1, H8[:2])))


# ---------------------------------------------------------------- hypothesis

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
u8 = st.integers(0, 255)
u32 = st.integers(0, U32)
u64 = st.integers(0, U64)
hash_ = st.binary(min_size=1, max_size=HASH_BYTES_MAX)
hash_lists = st.one_of(
    st.lists(hash_, max_size=12),  # usually mixed widths
    st.sampled_from([8, 16, 32, 1]).flatmap(
        lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=12)
    ),
)


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    hs = draw(hash_lists)
    n = len(hs)

    def col(ints: st.SearchStrategy[int]) -> list[int]:
        return draw(st.lists(ints, min_size=n, max_size=n))

    return Publish(
        draw(texts), draw(u64), draw(texts), draw(u8), hs, col(u64), col(u32), col(u32), col(u64)
    )


@st.composite
def removes(draw: st.DrawFn) -> Remove:
    hs = draw(hash_lists)
    n = len(hs)
    gens = draw(st.one_of(st.just([]), st.lists(u64, min_size=n, max_size=n)))
    addrs = draw(st.one_of(st.just([]), st.lists(u64, min_size=n, max_size=n)))
    return Remove(draw(texts), draw(u64), draw(texts), draw(u8), hs, gens, addrs)


commands: st.SearchStrategy[Command] = st.one_of(
    st.builds(
        RegisterNode, texts, texts, texts, st.lists(texts, max_size=8).map(tuple), u64, u32, u64
    ),
    st.builds(Heartbeat, texts, u64, u64),
    publishes(),
    removes(),
    st.builds(ClearNode, texts, u64, st.none() | texts, st.booleans()),
    st.builds(ExpireNodes, u64, st.lists(st.tuples(texts, u64), max_size=6).map(tuple)),
    st.just(Barrier()),
    st.builds(
        SetShardMap,
        u64,
        st.integers(1, 4).map(lambda n: even_map([Group(f"g{i}", ("h:1",)) for i in range(n)])),
    ),
    st.builds(FreezeShard, u32, st.just(0), st.integers(1, 2**64)),
    st.builds(BeginImport, u32, st.just(5), st.integers(6, 2**64)),
    st.builds(Import, u32, st.one_of(publishes(), removes())),
    st.builds(ImportDone, u32),
    st.builds(DropShard, u32, u8),
)


@settings(max_examples=400, deadline=None)
@given(commands)
def test_roundtrip_property(cmd: Command) -> None:
    blob = encode(cmd)
    assert decode(blob) == cmd
    assert encode(decode(blob)) == blob


def _decode_or_codec_error(blob: bytes) -> Command | None:
    try:
        return decode(blob)
    except CodecError:
        return None


def _check_decodes_cleanly(blob: bytes) -> None:
    """Contract: a CodecError or a command, and a decoded command re-encodes to
    bytes that decode to the same command."""
    cmd = _decode_or_codec_error(blob)
    if cmd is not None:
        assert decode(encode(cmd)) == cmd


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_decode_arbitrary_bytes(blob: bytes) -> None:
    _check_decodes_cleanly(blob)


@settings(max_examples=600, deadline=None)
@given(kind=st.integers(0, 14), body=st.binary(max_size=80))
@example(
    kind=4,
    body=b"\x00\x00"
    + b"\x00" * 8
    + b"\x00\x00"
    + b"\x01"
    + b"\x00" * 4
    + b"\x00\x00"
    + b"\x00" * 4,
)
def test_decode_arbitrary_bodies(kind: int, body: bytes) -> None:
    _check_decodes_cleanly(MAGIC + bytes((VERSION, kind)) + body)


@settings(max_examples=600, deadline=None)
@given(cmd=commands, data=st.data())
def test_decode_mutated_encodings(cmd: Command, data: st.DataObject) -> None:
    blob = bytearray(encode(cmd))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]), label="op")
        pos = data.draw(st.integers(0, max(len(blob) - 1, 0)), label="pos")
        if op == "flip" and blob:
            blob[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "set" and blob:
            blob[pos] = data.draw(u8, label="byte")
        elif op == "cut":
            del blob[pos:]
        elif op == "insert":
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=4), label="ins")
        elif op == "delete" and blob:
            del blob[pos]
    _check_decodes_cleanly(bytes(blob))


# --------------------------------------------------------------- malformed


def _raises_codec_error(blob: bytes) -> None:
    with pytest.raises(CodecError):
        decode(blob)


@pytest.mark.parametrize("cmd", EXAMPLES, ids=ids(EXAMPLES))
def test_every_truncation_is_a_codec_error(cmd: Command) -> None:
    blob = encode(cmd)
    for cut in range(len(blob)):
        _raises_codec_error(blob[:cut])


@pytest.mark.parametrize("cmd", EXAMPLES, ids=ids(EXAMPLES))
def test_trailing_bytes_are_a_codec_error(cmd: Command) -> None:
    blob = encode(cmd)
    _raises_codec_error(blob + b"\x00")
    _raises_codec_error(blob + blob)


@pytest.mark.parametrize("blob", [b"", b"K", b"K\x01", b"X\x01\x07", b"k\x01\x07", b"\x00" * 8])
def test_bad_magic_or_too_short(blob: bytes) -> None:
    _raises_codec_error(blob)


@pytest.mark.parametrize("version", [0, VERSION + 1, 255])
def test_unknown_version(version: int) -> None:
    blob = bytearray(encode(Heartbeat("n", 1, 2)))
    blob[1] = version
    with pytest.raises(CodecError, match="version"):
        decode(bytes(blob))


@pytest.mark.parametrize("kind", [0, 14, 15, 255])
def test_unknown_command_type(kind: int) -> None:
    with pytest.raises(CodecError, match="unknown command type"):
        decode(MAGIC + bytes((VERSION, kind)))


def test_a_type_is_unknown_in_a_version_older_than_it() -> None:
    blob = bytearray(encode(SetShardMap(0, even_map([Group("g0", ("h:1",))]))))
    blob[1] = 2
    with pytest.raises(CodecError, match="unknown command type 8 in format version 2"):
        decode(bytes(blob))


def test_an_import_carries_only_source_log_commands() -> None:
    inner = encode(Barrier())
    blob = MAGIC + bytes((VERSION, 11)) + struct.pack("<II", 1, len(inner)) + inner
    with pytest.raises(CodecError, match="an Import cannot carry a Barrier"):
        decode(blob)


def test_older_commands_read_in_either_version() -> None:
    blob = bytearray(encode(Heartbeat("n", 1, 2)))
    for version in VERSIONS_READ:
        blob[1] = version
        assert decode(bytes(blob)) == Heartbeat("n", 1, 2)


@pytest.mark.parametrize(
    "text",
    [b"{}", b"[1]", b'{"version": Infinity, "groups": [], "shards": []}', b"[" * 5000, b"\xff"],
)
def test_a_bad_shard_map_is_a_codec_error(text: bytes) -> None:
    blob = MAGIC + bytes((VERSION, 8)) + struct.pack("<QI", 0, len(text)) + text
    _raises_codec_error(blob)


def _remove_header() -> bytes:
    """A Remove up to its hash batch: node "n", incarnation 1, namespace "s", tier 1."""
    return (
        MAGIC
        + bytes((2, 4))  # Remove is written in format 2 (codec._SINCE)
        + struct.pack("<H", 1)
        + b"n"
        + struct.pack("<Q", 1)
        + struct.pack("<H", 1)
        + b"s"
        + b"\x01"
    )


NO_GUARDS = struct.pack("<II", 0, 0)
"""A Remove's empty generations and addresses columns."""


def test_hand_built_remove_matches_encoder() -> None:
    blob = _remove_header() + struct.pack("<I", 2) + b"\x00\x01" + b"ab" + NO_GUARDS
    assert decode(blob) == Remove("n", 1, "s", 1, [b"a", b"b"])
    assert encode(Remove("n", 1, "s", 1, [b"a", b"b"])) == blob


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(
            struct.pack("<I", 1)
            + b"\x00"
            + bytes((HASH_BYTES_MAX + 1,))
            + b"x" * (HASH_BYTES_MAX + 1),
            id="mode0-too-wide",
        ),
        pytest.param(struct.pack("<I", 2) + b"\x00\x00", id="mode0-zero-width"),
        pytest.param(struct.pack("<I", 2) + b"\x01\x08\x00" + b"x" * 8, id="mode1-zero-width"),
        pytest.param(struct.pack("<I", 2) + b"\x01\x08\x21" + b"x" * 41, id="mode1-too-wide"),
        pytest.param(struct.pack("<I", 1) + b"\x02\x08" + b"x" * 8, id="unknown-mode"),
    ],
)
def test_bad_hash_batch(batch: bytes) -> None:
    _raises_codec_error(_remove_header() + batch + NO_GUARDS)


def test_encoded_too_wide_hash_is_refused_on_decode() -> None:
    for hs in ([b"x" * 33], [b"x" * 8, b"y" * 40]):
        _raises_codec_error(encode(Remove("n", 1, "ns", 1, hs)))
        _raises_codec_error(
            encode(
                Publish(
                    "n", 1, "ns", 1, hs, [0] * len(hs), [0] * len(hs), [0] * len(hs), [0] * len(hs)
                )
            )
        )


@pytest.mark.parametrize(
    "guards",
    [
        pytest.param(struct.pack("<IQI", 1, 1, 0), id="one-generation"),
        pytest.param(struct.pack("<II3Q", 0, 3, 1, 2, 3), id="three-addresses"),
        pytest.param(struct.pack("<I2QIQ", 2, 1, 2, 1, 1), id="one-address"),
    ],
)
def test_remove_guard_count_mismatch(guards: bytes) -> None:
    batch = struct.pack("<I", 2) + b"\x00\x01" + b"ab"
    assert decode(_remove_header() + batch + NO_GUARDS) == Remove("n", 1, "s", 1, [b"a", b"b"])
    with pytest.raises(CodecError, match="match"):
        decode(_remove_header() + batch + guards)


def test_invalid_utf8_is_a_codec_error() -> None:
    blob = encode(Heartbeat("ab", 1, 2))
    bad = blob.replace(b"ab", b"\xff\xfe", 1)
    with pytest.raises(CodecError, match="UTF-8"):
        decode(bad)


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(codec.CodecError, ValueError)
