"""Sending one hostile case to a real server and naming what came back.

An outcome is a short label that the tally counts: a gRPC status name, a tcp
reply status, a decoder result. Labels in CRASHES mean the server (or the
decoder) failed instead of refusing: an unhandled exception, wrong bytes
served, a peer read outside its grant.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvdir.agent.events.decode import DecodeError, decode_batch
from kvdir.transfer import tcp

CRASHES = frozenset(
    {"INTERNAL", "UNKNOWN", "DATA_LOSS", "wrong-bytes", "read-outside-grant", "decoder-crash"}
)
GRPC_TIMEOUT_S = 10.0
TCP_REPLY_TIMEOUT_S = 2.0
REFUSED_CODES = frozenset(
    {
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
    }
)


@dataclass
class Tally:
    """Cases tried and outcomes, per target; the first few crash inputs kept."""

    cases: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    CRASH_SAMPLES_MAX = 20

    def record(self, target: str, outcome: str, case: bytes | str = b"") -> None:
        self.cases[target] += 1
        self.outcomes.setdefault(target, Counter())[outcome] += 1
        if outcome in CRASHES and len(self.crashes) < self.CRASH_SAMPLES_MAX:
            sample = case[:120] if isinstance(case, bytes) else case[:240]
            self.crashes.append(f"{target}: {outcome}: {sample!r}")

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    @property
    def crash_count(self) -> int:
        return sum(n for c in self.outcomes.values() for k, n in c.items() if k in CRASHES)


# ----------------------------------------------------------------- gRPC


def grpc_raw(channel: grpc.Channel, method: str, payload: bytes) -> str:
    """Call `method` with `payload` as the request bytes; the status name."""
    call = channel.unary_unary(method, None, None)  # bytes go out as they are
    try:
        call(payload, timeout=GRPC_TIMEOUT_S)
    except grpc.RpcError as e:
        return _status_name(e)
    return "OK"


def grpc_stream_raw(channel: grpc.Channel, method: str, payload: bytes) -> str:
    """Call server-streaming `method` with `payload`: the status name once its first
    message or its status came ("OK" for a message), then the stream is cancelled.

    An accepted Watch streams until its deadline: called as unary, each accepted
    case cost the whole GRPC_TIMEOUT_S (110 of the tier's 125 s). A refusal still
    comes as the status, before any message; the cancel exercises the server's
    clean-up of a stream its caller left."""
    # Any: grpc-stubs' CallIterator declares neither __next__ nor a typed cancel().
    stream: Any = channel.unary_stream(method, None, None)(payload, timeout=GRPC_TIMEOUT_S)
    try:
        next(stream)
    except StopIteration:
        return "OK"
    except grpc.RpcError as e:
        return _status_name(e)
    finally:
        stream.cancel()
    return "OK"


def _status_name(e: grpc.RpcError) -> str:
    code = e.code()
    name = code.name if code is not None else "UNKNOWN"
    if name in REFUSED_CODES and not (e.details() or "").strip():
        return f"{name}-without-message"
    return str(name)


# ------------------------------------------------------------------ tcp


@dataclass(frozen=True, slots=True)
class Grant:
    """What a holder granted: one region under one rkey, and its bytes (mapped)."""

    address: int
    length: int
    rkey: int
    path: str

    @contextmanager
    def mapped(self) -> Iterator[mmap.mmap]:
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            yield mm
        finally:
            mm.close()


def _recv(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def tcp_raw(endpoint: str, payload: bytes) -> str:
    """Send `payload` on a fresh connection; how the holder answered."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=TCP_REPLY_TIMEOUT_S) as s:
        # The holder may answer and hang up before it has read everything we
        # send; what it said is still waiting to be read.
        with contextlib.suppress(OSError):
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        try:
            head = _recv(s, tcp._HEAD.size)
        except TimeoutError:
            return "waiting-for-more"
        except ConnectionResetError:
            return "reset"
    if head is None:
        return "closed"
    magic, _, status, _, _, _ = tcp._HEAD.unpack(head)
    if magic != tcp.MAGIC:
        return "wrong-bytes"
    return {tcp.STATUS_OK: "ok", tcp.STATUS_DENIED: "denied"}.get(status, "bad-request")


def read_request(segments: list[tuple[int, int, int]], req_id: int = 7) -> bytes:
    head = tcp._HEAD.pack(tcp.MAGIC, tcp.VERSION, tcp.OP_READ, 0, len(segments), req_id)
    return head + b"".join(tcp._SEG.pack(a, k, n) for a, k, n in segments)


def tcp_read(endpoint: str, grant: Grant, segments: list[tuple[int, int, int]]) -> str:
    """A well-formed read; checks the holder served exactly what the grant allows.

    Every segment inside the grant: the reply must be OK and carry the region's
    bytes. Any segment outside it: the reply must be DENIED (or, over the
    request byte cap, BAD_REQUEST) and carry no data.
    """
    inside = all(
        k == grant.rkey and n > 0 and grant.address <= a and a + n <= grant.address + grant.length
        for a, k, n in segments
    )
    total = sum(n for _, _, n in segments)
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=TCP_REPLY_TIMEOUT_S * 5) as s:
        s.sendall(read_request(segments))
        head = _recv(s, tcp._HEAD.size)
        if head is None:
            return "closed"
        _, _, status, _, _, _ = tcp._HEAD.unpack(head)
        if status != tcp.STATUS_OK:
            if inside and total <= tcp.REQUEST_BYTES_MAX:
                return "wrong-bytes"  # a granted read was refused
            return "denied" if status == tcp.STATUS_DENIED else "bad-request"
        if not inside:
            return "read-outside-grant"
        body = _recv(s, total)
    if body is None:
        return "closed"
    with grant.mapped() as mm:  # the grant is the whole pool file, from offset 0
        want = b"".join(mm[a - grant.address : a - grant.address + n] for a, _, n in segments)
    return "ok" if body == want else "wrong-bytes"


# -------------------------------------------------------------- decoder


def decode(payload: bytes) -> str:
    """The KV-event decoder on `payload`: a batch, a DecodeError reason, or a crash."""
    try:
        batch = decode_batch(payload)
    except DecodeError as e:
        return f"DecodeError:{e.reason}"
    except Exception:  # RecursionError and anything else the decoder let escape
        return "decoder-crash"
    return "batch-with-bad-events" if batch.bad_events else "batch"
