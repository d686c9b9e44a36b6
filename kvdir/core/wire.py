"""What crosses a process boundary, defined once: versions, message bounds, field
sizes, and the namespace key.

The namespace key is the one spelling of "which KV a block belongs to" that
every process agrees on: the directory's table, the agent's pools and peers,
the gateway and the engine connectors all key by it. It is built from the
namespace's fields with a fixed separator, never from serialized protobuf
bytes (protobuf promises no stable serialization across versions or
languages).
"""

from __future__ import annotations

import socket
import struct

from kvdir.v1 import directory_pb2 as pb

AGENT_WIRE_VERSION = 1
"""The agents' peer protocol (Handshake, Fetch, ConnectRdma): peers refuse another."""

GRPC_MESSAGE_BYTES_MAX = 64 * 1024 * 1024
"""Largest gRPC message any kvdir server or client sends or accepts."""

HASH_BYTES_MAX = 32
"""Engines hash blocks to u64 (8 bytes) or to 32-byte digests."""

LOOKUP_SOCKET_SUFFIX = ".lookup"
"""The agent's lookup socket is its engine socket's path plus this (agent/lookup_socket.py)."""
LOOKUP_REQUEST_HEADER = struct.Struct("<I")
"""A lookup socket request: u32 (method << FRAME_METHOD_SHIFT | length), then the
method's request: an EngineLookupRequest (FRAME_LOOKUP) or a FetchRequest (FRAME_FETCH)."""
LOOKUP_ANSWER_HEADER = struct.Struct("<BI")
"""Its answer: u8 gRPC status code number, u32 length, then the method's response
(status 0) or the refusal's message in UTF-8."""
FRAME_METHOD_SHIFT = 28
"""A request header's top 4 bits name its method; lengths stay below 2**28 (256 MiB,
over GRPC_MESSAGE_BYTES_MAX). The first agents knew lookups only: they read a fetch
frame's header as a length over their bound and answer INVALID_ARGUMENT with
FRAME_TOO_LONG, which tells an engine to fetch over gRPC."""
FRAME_LENGTH_MASK = (1 << FRAME_METHOD_SHIFT) - 1
FRAME_LOOKUP = 0
FRAME_FETCH = 1
FRAME_TOO_LONG = "frame of "
"""How an agent's refusal of an over-long frame starts (and the first agents' refusal of
any fetch frame)."""
FRAME_UNKNOWN_METHOD = "unknown frame method"
"""How an agent's refusal of a method it does not serve starts (the connection stays)."""


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes of a lookup socket frame, or None when the peer closed before the
    first of them (a connection ending between frames); ConnectionError when it
    closed in the middle."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            if buf:
                raise ConnectionError(f"the peer closed mid-frame ({len(buf)} of {n} bytes)")
            return None
        buf += got
    return bytes(buf)


NODE_ID_BYTES_MAX = 128
HOST_BYTES_MAX = 256
ENDPOINT_BYTES_MAX = 256
TRANSPORTS_MAX = 8
TRANSPORT_NAME_BYTES_MAX = 32
NAMESPACE_FIELD_BYTES_MAX = 256

_SEP = "\x1f"  # ASCII unit separator: refused inside fields, so keys never collide


class BadNamespace(ValueError):
    """A namespace that cannot name KV: a required field missing or out of bounds."""


NAMESPACE_KEYS_CACHED_MAX = 1024
"""Keys remembered by `namespace_key` (a fleet serves a handful of namespaces)."""
_keys: dict[tuple[str, str, int, str, int, int], str] = {}


def namespace_key(ns: pb.Namespace) -> str:
    """The canonical string of a namespace: model, dtype, block size, layout, TP shard.

    Remembered per field tuple: every lookup, publish and routed request asks,
    and checking and joining the fields cost more than a dict probe."""
    fields = (ns.model, ns.dtype, ns.block_tokens, ns.layout, ns.tp_rank, ns.tp_size)
    key = _keys.get(fields)
    if key is None:
        key = _namespace_key(ns)
        if len(_keys) >= NAMESPACE_KEYS_CACHED_MAX:
            _keys.clear()
        _keys[fields] = key
    return key


def namespace_of(key: str) -> pb.Namespace:
    """The namespace `key` names (`namespace_key`'s inverse)."""
    model, dtype, block_tokens, layout, tp = key.split(_SEP)
    rank, size = tp.split("/")
    return pb.Namespace(
        model=model, dtype=dtype, block_tokens=int(block_tokens), layout=layout,
        tp_rank=int(rank), tp_size=int(size),
    )  # fmt: skip


def _namespace_key(ns: pb.Namespace) -> str:
    if not ns.model:
        raise BadNamespace("namespace.model is required")
    if ns.block_tokens == 0:
        raise BadNamespace("namespace.block_tokens must be > 0")
    for name in ("model", "dtype", "layout"):
        value = getattr(ns, name)
        if len(value.encode()) > NAMESPACE_FIELD_BYTES_MAX:
            raise BadNamespace(f"namespace.{name} is longer than {NAMESPACE_FIELD_BYTES_MAX} bytes")
        if _SEP in value:
            raise BadNamespace(f"namespace.{name} contains a control character")
    if ns.tp_size and ns.tp_rank >= ns.tp_size:
        raise BadNamespace("namespace.tp_rank must be < tp_size")
    fields = (ns.model, ns.dtype, str(ns.block_tokens), ns.layout, f"{ns.tp_rank}/{ns.tp_size}")
    return _SEP.join(fields)
