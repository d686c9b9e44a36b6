"""Explicit, versioned byte form of the replicated commands (never pickle).

Layout: ``b"K"``, a format version byte, a command type byte, then the
command's fields little-endian. Strings are u16-length-prefixed UTF-8. A batch
of hashes is u32 count, then either mode 0 (all the same length: u8 length and
the concatenation, the common case) or mode 1 (a u8 length per hash, then the
concatenation). Numeric columns are packed with one `struct` call each, since
per-entry Python work is what bounds publish throughput.

A reader refuses a version it does not know, so a replica running older code
stops loudly instead of misreading a newer log. Each command is written with
the oldest version that has its type (`_SINCE`): adding a command type leaves
the bytes of every older type as they were, so a log that never holds the new
type stays readable by the previous release.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from kvdir.core.shard_map import ShardMap, ShardMapError
from kvdir.core.wire import HASH_BYTES_MAX
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
from kvdir.directory.limits import COMMAND_BYTES_MAX, SHARD_MAP_BYTES_MAX

MAGIC = b"K"
VERSION = 3  # 2: Remove carries an address guard; 3: SetShardMap and the move commands
VERSIONS_READ = (2, 3)

_T_REGISTER = 1
_T_HEARTBEAT = 2
_T_PUBLISH = 3
_T_REMOVE = 4
_T_CLEAR = 5
_T_EXPIRE = 6
_T_BARRIER = 7
_T_SET_SHARD_MAP = 8
_T_FREEZE = 9
_T_BEGIN_IMPORT = 10
_T_IMPORT = 11
_T_IMPORT_DONE = 12
_T_DROP = 13

_SINCE = {
    t: 3 for t in (_T_SET_SHARD_MAP, _T_FREEZE, _T_BEGIN_IMPORT, _T_IMPORT, _T_IMPORT_DONE, _T_DROP)
}
"""The format version that introduced a command type (the rest: 2)."""

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class CodecError(ValueError):
    """The bytes are not a command this version can read."""


class _Writer:
    __slots__ = ("parts",)

    def __init__(self, kind: int) -> None:
        self.parts: list[bytes] = [MAGIC, bytes((_SINCE.get(kind, 2), kind))]

    def u8(self, v: int) -> None:
        self.parts.append(_U8.pack(v))

    def u32(self, v: int) -> None:
        self.parts.append(_U32.pack(v))

    def u64(self, v: int) -> None:
        self.parts.append(_U64.pack(v))

    def text(self, s: str) -> None:
        b = s.encode()
        self.parts.append(_U16.pack(len(b)))
        self.parts.append(b)

    def long_text(self, s: str) -> None:
        b = s.encode()
        self.parts.append(_U32.pack(len(b)))
        self.parts.append(b)

    def column(self, code: str, values: Sequence[int]) -> None:
        self.parts.append(struct.pack(f"<{len(values)}{code}", *values))

    def hashes(self, hs: Sequence[bytes]) -> None:
        n = len(hs)
        self.parts.append(_U32.pack(n))
        width = len(hs[0]) if n else 0
        if all(len(h) == width for h in hs):
            self.parts.append(bytes((0, width)))
        else:
            self.parts.append(b"\x01")
            self.parts.append(bytes(len(h) for h in hs))
        self.parts.append(b"".join(hs))

    def done(self) -> bytes:
        return b"".join(self.parts)


_COLUMN_CODES = "BHIQ"
_WIRE_SIZE = {c: struct.calcsize("<" + c) for c in _COLUMN_CODES}
"""Bytes per value of a column code on the wire (standard sizes, little-endian)."""
_ARRAY_SIZE = {c: array(c).itemsize for c in _COLUMN_CODES}
"""Bytes per value of that code in an `array` here: where it differs from the wire
(a platform whose C int is not 4 bytes) columns are unpacked by `struct` instead."""


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise CodecError("truncated command")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def text(self) -> str:
        try:
            return self.take(self.u16()).decode()
        except UnicodeDecodeError as e:
            raise CodecError("string is not UTF-8") from e

    def long_text(self, limit: int) -> str:
        n = self.u32()
        if n > limit:
            raise CodecError(f"a text of {n} bytes (at most {limit})")
        try:
            return self.take(n).decode()
        except UnicodeDecodeError as e:
            raise CodecError("string is not UTF-8") from e

    def column(self, code: str, n: int) -> list[int]:
        size = _WIRE_SIZE[code]
        raw = self.take(n * size)
        if _ARRAY_SIZE[code] != size:
            return list(struct.unpack(f"<{n}{code}", raw))
        col = array(code, raw)  # one copy, then ints: half of unpacking to a tuple first
        if sys.byteorder != "little":
            col.byteswap()
        return col.tolist()

    def hashes(self) -> list[bytes]:
        n = self.u32()
        mode = self.u8()
        if mode == 0:
            w = self.u8()
            if n == 0:
                return []
            if not 1 <= w <= HASH_BYTES_MAX:
                raise CodecError(f"hash width {w} out of range")
            blob = self.take(n * w)
            return [blob[i : i + w] for i in range(0, n * w, w)]
        if mode != 1:
            raise CodecError(f"unknown hash mode {mode}")
        widths = self.take(n)
        out: list[bytes] = []
        blob = self.take(sum(widths))
        pos = 0
        for w in widths:
            if not 1 <= w <= HASH_BYTES_MAX:
                raise CodecError(f"hash width {w} out of range")
            out.append(blob[pos : pos + w])
            pos += w
        return out

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise CodecError(f"{len(self.buf) - self.pos} trailing bytes")


def encode(cmd: Command) -> bytes:
    """Encode a command; the caller has validated field ranges."""
    match cmd:
        case RegisterNode():
            w = _Writer(_T_REGISTER)
            w.text(cmd.node_id)
            w.text(cmd.host)
            w.text(cmd.endpoint)
            w.u8(len(cmd.transports))
            for t in cmd.transports:
                w.text(t)
            w.u64(cmd.incarnation)
            w.u32(cmd.lease_ms)
            w.u64(cmd.now_ms)
        case Heartbeat():
            w = _Writer(_T_HEARTBEAT)
            w.text(cmd.node_id)
            w.u64(cmd.incarnation)
            w.u64(cmd.now_ms)
        case Publish():
            w = _Writer(_T_PUBLISH)
            _node_ns_tier(w, cmd.node_id, cmd.incarnation, cmd.namespace, cmd.tier)
            w.hashes(cmd.hashes)
            w.column("Q", cmd.addresses)
            w.column("I", cmd.lengths)
            w.column("I", cmd.rkeys)
            w.column("Q", cmd.generations)
        case Remove():
            w = _Writer(_T_REMOVE)
            _node_ns_tier(w, cmd.node_id, cmd.incarnation, cmd.namespace, cmd.tier)
            w.hashes(cmd.hashes)
            w.u32(len(cmd.generations))
            w.column("Q", cmd.generations)
            w.u32(len(cmd.addresses))
            w.column("Q", cmd.addresses)
        case ClearNode():
            w = _Writer(_T_CLEAR)
            w.text(cmd.node_id)
            w.u64(cmd.incarnation)
            w.u8(cmd.namespace is not None)
            if cmd.namespace is not None:
                w.text(cmd.namespace)
            w.u8(cmd.deregister)
        case ExpireNodes():
            w = _Writer(_T_EXPIRE)
            w.u64(cmd.now_ms)
            w.u32(len(cmd.nodes))
            for node_id, incarnation in cmd.nodes:
                w.text(node_id)
                w.u64(incarnation)
        case Barrier():
            w = _Writer(_T_BARRIER)
        case SetShardMap():
            w = _Writer(_T_SET_SHARD_MAP)
            w.u64(cmd.expected_version)
            w.long_text(cmd.shard_map.to_json())
        case FreezeShard() | BeginImport():
            w = _Writer(_T_FREEZE if isinstance(cmd, FreezeShard) else _T_BEGIN_IMPORT)
            w.u32(cmd.shard_id)
            _key_range(w, cmd.lo, cmd.hi)
        case Import():
            w = _Writer(_T_IMPORT)
            w.u32(cmd.shard_id)
            inner = encode(cmd.inner)
            w.u32(len(inner))
            w.parts.append(inner)
        case ImportDone():
            w = _Writer(_T_IMPORT_DONE)
            w.u32(cmd.shard_id)
        case DropShard():
            w = _Writer(_T_DROP)
            w.u32(cmd.shard_id)
            w.u8(cmd.part)
    blob = w.done()
    # Validation bounds every field (limits.py ties batch sizes to this), so a
    # longer command is a programmer error, never an operator's.
    assert len(blob) <= COMMAND_BYTES_MAX, f"command of {len(blob)} bytes"
    return blob


def _node_ns_tier(w: _Writer, node_id: str, incarnation: int, namespace: str, tier: int) -> None:
    w.text(node_id)
    w.u64(incarnation)
    w.text(namespace)
    w.u8(tier)


def _register(r: _Reader) -> Command:
    node_id, host, endpoint = r.text(), r.text(), r.text()
    transports = tuple(r.text() for _ in range(r.u8()))
    return RegisterNode(node_id, host, endpoint, transports, r.u64(), r.u32(), r.u64())


def _heartbeat(r: _Reader) -> Command:
    return Heartbeat(r.text(), r.u64(), r.u64())


def _publish(r: _Reader) -> Command:
    node_id, incarnation, namespace, tier = r.text(), r.u64(), r.text(), r.u8()
    hashes = r.hashes()
    n = len(hashes)
    return Publish(
        node_id,
        incarnation,
        namespace,
        tier,
        hashes,
        r.column("Q", n),
        r.column("I", n),
        r.column("I", n),
        r.column("Q", n),
    )


def _remove(r: _Reader) -> Command:
    node_id, incarnation, namespace, tier = r.text(), r.u64(), r.text(), r.u8()
    hashes = r.hashes()
    generations = r.column("Q", r.u32())
    addresses = r.column("Q", r.u32())
    for guard in (generations, addresses):
        if guard and len(guard) != len(hashes):
            raise CodecError("remove guards do not match hashes")
    return Remove(node_id, incarnation, namespace, tier, hashes, generations, addresses)


def _clear(r: _Reader) -> Command:
    node_id, incarnation = r.text(), r.u64()
    namespace = r.text() if r.u8() else None
    return ClearNode(node_id, incarnation, namespace, bool(r.u8()))


def _expire(r: _Reader) -> Command:
    now_ms = r.u64()
    nodes = tuple((r.text(), r.u64()) for _ in range(r.u32()))
    return ExpireNodes(now_ms, nodes)


def _barrier(_r: _Reader) -> Command:
    return Barrier()


def _key_range(w: _Writer, lo: int, hi: int) -> None:
    # hi may be 2**64: written as hi - 1 (the range is never empty: lo < hi).
    w.u64(lo)
    w.u64(hi - 1)


def _read_range(r: _Reader) -> tuple[int, int]:
    lo, last = r.u64(), r.u64()
    if last < lo:
        raise CodecError(f"empty key range [{lo}, {last}]")
    return lo, last + 1


def _freeze(r: _Reader) -> Command:
    return FreezeShard(r.u32(), *_read_range(r))


def _begin_import(r: _Reader) -> Command:
    return BeginImport(r.u32(), *_read_range(r))


def _import(r: _Reader) -> Command:
    shard_id = r.u32()
    inner = decode(r.take(r.u32()))
    if not isinstance(inner, Publish | Remove | ClearNode | ExpireNodes):
        raise CodecError(f"an Import cannot carry a {type(inner).__name__}")
    return Import(shard_id, inner)


def _import_done(r: _Reader) -> Command:
    return ImportDone(r.u32())


def _drop(r: _Reader) -> Command:
    return DropShard(r.u32(), r.u8())


def _set_shard_map(r: _Reader) -> Command:
    expected = r.u64()
    try:
        return SetShardMap(expected, ShardMap.from_json(r.long_text(SHARD_MAP_BYTES_MAX)))
    except (ShardMapError, RecursionError) as e:  # deep nesting: json's own limit
        raise CodecError(f"bad shard map: {e}") from e


_DECODERS: dict[int, Callable[[_Reader], Command]] = {
    _T_REGISTER: _register,
    _T_HEARTBEAT: _heartbeat,
    _T_PUBLISH: _publish,
    _T_REMOVE: _remove,
    _T_CLEAR: _clear,
    _T_EXPIRE: _expire,
    _T_BARRIER: _barrier,
    _T_SET_SHARD_MAP: _set_shard_map,
    _T_FREEZE: _freeze,
    _T_BEGIN_IMPORT: _begin_import,
    _T_IMPORT: _import,
    _T_IMPORT_DONE: _import_done,
    _T_DROP: _drop,
}


def decode(buf: bytes) -> Command:
    """Decode one command; raises CodecError on anything malformed."""
    if len(buf) < 3 or buf[:1] != MAGIC:
        raise CodecError("not a kvdir command")
    if len(buf) > COMMAND_BYTES_MAX:
        raise CodecError(f"a command of {len(buf)} bytes (at most {COMMAND_BYTES_MAX})")
    if buf[1] not in VERSIONS_READ:
        raise CodecError(f"command format version {buf[1]} is not supported (this is {VERSION})")
    decoder = _DECODERS.get(buf[2])
    if decoder is None or buf[1] < _SINCE.get(buf[2], 2):
        raise CodecError(f"unknown command type {buf[2]} in format version {buf[1]}")
    r = _Reader(buf, 3)
    try:
        cmd = decoder(r)
    except struct.error as e:
        raise CodecError(str(e)) from e
    r.end()
    return cmd
