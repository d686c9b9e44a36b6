"""Hostile inputs as hypothesis strategies (a dev dependency: imported lazily).

Every gRPC method gets the same families, built from its request type's
descriptor so new fields are fuzzed without edits here:

- garbage: random bytes;
- mutated: a structured request of the right type, then bytes flipped,
  cut or inserted;
- confused: a valid request of some *other* method's type;
- nested: protobuf groups or length-delimited fields nested thousands deep;
- structured: the right type with hostile values (boundary integers, unknown
  enum numbers, huge repeated fields, odd unicode), optionally pinned to a
  namespace the target serves so the handler gets past its first check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

NEST_DEPTH_MAX = 20_000
REPEATED_SMALL_MAX = 8
REPEATED_HUGE = (5_000, 70_000)
"""Sizes of the occasional huge repeated scalar field (over every kvdir limit)."""
REPEATED_HUGE_MESSAGES = (300, 5_000)
"""The same for repeated messages (each is built field by field: slower)."""
MESSAGE_DEPTH_MAX = 3

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, 4096, 2**31, 2**32) if lo <= v <= hi]
    return st.one_of(
        st.sampled_from(edges),
        st.integers(lo, hi),
        st.integers(-3, 70_000).filter(lambda v: lo <= v <= hi),
    )


def _scalar(field: Any, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(
            st.text(max_size=64),
            st.sampled_from(["", "\x00", "a" * 300, "../../etc/passwd", "\U0001f600" * 40]),
        )
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=8, max_size=8))
    if t == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 12)  # open enums keep unknown numbers
    if t in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
        return message_values(field.message_type, depth + 1)
    raise AssertionError(f"unhandled field type {t}")


def _field(field: Any, depth: int) -> st.SearchStrategy[Any]:
    one = _scalar(field, depth)
    if not field.is_repeated:
        return one
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return st.dictionaries(st.text(max_size=16), st.text(max_size=16), max_size=40)
    small = st.lists(one, max_size=REPEATED_SMALL_MAX)
    if depth > 0:
        # Huge fields only at the top: 5,000 messages of 70,000 items each
        # would be 350M values (gigabytes) in the fuzzer itself.
        return small
    sizes = REPEATED_HUGE if field.message_type is None else REPEATED_HUGE_MESSAGES
    huge = st.tuples(one, st.sampled_from(sizes)).map(lambda vn: [vn[0]] * vn[1])
    return st.one_of(small, small, small, huge)


def message_values(desc: Any, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of field name -> hostile value for message type `desc`."""
    if depth > MESSAGE_DEPTH_MAX:
        return st.just({})
    fields = {f.name: _field(f, depth) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields)


def _fill(msg: Message, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(msg, name).update(value)
        elif field.is_repeated:
            if field.message_type is not None:
                for v in value:
                    _fill(getattr(msg, name).add(), v)
            else:
                getattr(msg, name).extend(value)
        elif field.message_type is not None:
            _fill(getattr(msg, name), value)
        else:
            setattr(msg, name, value)


def _same_length_columns(cls: type[Message], values: dict[str, Any]) -> dict[str, Any]:
    """Cut every non-empty repeated scalar field to the shortest one's length, so
    column-shaped requests (a publish's hashes, addresses, lengths, ...) agree."""
    columns = [
        name
        for name, v in values.items()
        if v and isinstance(v, list) and cls.DESCRIPTOR.fields_by_name[name].message_type is None
    ]
    if not columns:
        return values
    n = min(len(values[c]) for c in columns)
    return {k: (v[:n] if k in columns else v) for k, v in values.items()}


def structured(
    cls: type[Message], pinned: Mapping[str, Any] | None = None
) -> st.SearchStrategy[bytes]:
    """Serialized requests of type `cls` with hostile values; `pinned` fields
    (a namespace and node the server knows, the wire version) are set half of
    the time, so handlers get past their first checks to the deeper ones."""

    def build(values: dict[str, Any], pin: bool) -> bytes:
        msg = cls()
        if pin:
            values = _same_length_columns(cls, values)
        _fill(msg, values)
        for name, value in (pinned or {}).items() if pin else ():
            if name not in msg.DESCRIPTOR.fields_by_name:
                continue
            if isinstance(value, Message):
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg.SerializeToString()

    return st.builds(build, message_values(cls.DESCRIPTOR), st.booleans())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def nested_groups(depth: int, field: int = 1) -> bytes:
    """`depth` protobuf groups inside each other (unknown fields the parser must skip)."""
    return _varint(field << 3 | 3) * depth + _varint(field << 3 | 4) * depth


def nested_messages(depth: int, field: int = 1) -> bytes:
    """Length-delimited field `field` nested `depth` times."""
    inner = b""
    for _ in range(depth):
        inner = _varint(field << 3 | 2) + _varint(len(inner)) + inner
    return inner


def nested() -> st.SearchStrategy[bytes]:
    depth = st.sampled_from([10, 64, 100, 101, 1000, 5000, NEST_DEPTH_MAX])
    field = st.integers(1, 20)
    return st.one_of(
        st.builds(nested_groups, depth, field),
        st.builds(nested_messages, st.sampled_from([10, 64, 101, 200, 1000]), field),
    )


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, value in ops:
        at = pos % (len(buf) + 1)
        if kind == 0 and buf:
            buf[at % len(buf)] ^= 1 << (value % 8)
        elif kind == 1:
            buf[at:at] = bytes([value % 256]) * (1 + value % 5)
        elif kind == 2:
            del buf[at : at + 1 + value % 9]
        else:
            buf = buf[:at]
    return bytes(buf)


def mutated(base: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    op = st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255))
    return st.builds(_mutate, base, st.lists(op, min_size=1, max_size=6))


def request_payloads(
    cls: type[Message],
    others: list[type[Message]],
    pinned: Mapping[str, Any] | None = None,
) -> st.SearchStrategy[tuple[str, bytes]]:
    """(family, bytes) for one method whose request type is `cls`."""
    good = structured(cls, pinned)
    confused = st.sampled_from(others).flatmap(structured)
    families: list[tuple[str, st.SearchStrategy[bytes]]] = [
        ("garbage", st.binary(max_size=2048)),
        ("mutated", mutated(good)),
        ("confused", confused),
        ("nested", nested()),
        ("structured", good),
    ]
    return st.one_of(*(s.map(_tag(name)) for name, s in families))


def _tag(name: str) -> Callable[[bytes], tuple[str, bytes]]:
    return lambda b: (name, b)
