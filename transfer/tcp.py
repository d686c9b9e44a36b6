"""The `tcp` backend: one-sided-style reads served by the holder's agent.

Wire format (little-endian), version 1, one TCP connection per (reader, holder):

    request   "KVDT" u8 version, u8 op=1 (READ), u16 0, u32 count, u64 request id,
              then count x (u64 address, u32 rkey, u32 length)
    response  "KVDT" u8 version, u8 status, u16 0, u32 count, u64 request id,
              then, when status is OK, the bytes of every segment in order;
              otherwise u32 length and a UTF-8 reason

The holder checks every segment against its `Registry` (rkey granted, range
inside the region) before sending a byte, so a reader can read only what was
registered. A request asks for at most REQUEST_BYTES_MAX bytes, and a segment
that cannot be sent within SEND_STALL_S (a reader that stopped draining its
socket) ends the connection, so hostile readers cannot pin the holder's
connection threads for long. The reader receives straight into its
destination slots (`recv_into` on slices of dst; no intermediate buffer) and
keeps several requests in flight on the connection so the holder's sends
never wait for a round trip.

With `TcpTls` (the agent's [tls]) every connection is TLS: the holder requires
a client certificate from the cluster CA, the reader verifies the holder's,
and the descriptor says so (``tls=1``), so neither side falls back to clear.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvdir.transfer.base import (
    AccessDenied,
    Channel,
    PeerUnavailable,
    Read,
    Region,
    TransferError,
    Transport,
    check_destination,
    coalesce,
)
from kvdir.transfer.memory import Registry

log = logging.getLogger("kvdir.transfer.tcp")

MAGIC = b"KVDT"
VERSION = 1
OP_READ = 1
STATUS_OK = 0
STATUS_DENIED = 1
STATUS_BAD_REQUEST = 2

_HEAD = struct.Struct("<4sBBHIQ")
_SEG = struct.Struct("<QII")
_U32 = struct.Struct("<I")

SEGMENTS_PER_REQUEST_MAX = 1024
REQUEST_BYTES_MAX = 64 << 20
REQUESTS_INFLIGHT_MAX = 8
CONNECTIONS_MAX = 256
TLS_HANDSHAKE_S = 5.0
SEND_STALL_S = 30.0
"""Longest send of one response segment (at most 64 MiB: over 2 MB/s) before hanging up."""


@dataclass(frozen=True, slots=True)
class TcpTls:
    """TLS contexts of one agent: `server` requires client certificates from the CA."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, dst: memoryview) -> None:
    got = 0
    n = len(dst)
    while got < n:
        k = sock.recv_into(dst[got:], n - got)
        if k == 0:
            raise PeerUnavailable("peer closed the connection")
        got += k


def _tune(sock: socket.socket) -> None:
    # Socket buffers are left to the kernel's autotuning: a fixed size turns it
    # off, and its ceiling is usually larger than anything we would pick.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpServer:
    """Serves reads of registered memory (the holder side). One thread per connection."""

    def __init__(
        self,
        registry: Registry,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.registry = registry
        self.tls = tls
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(CONNECTIONS_MAX)
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.bytes_served = 0
        self.denied = 0
        self._thread = threading.Thread(
            target=self._accept_loop, name="kvdir-tcp-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # over CONNECTIONS_MAX: refuse rather than queue
                continue
            _tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kvdir-tcp-conn", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> socket.socket:
        if self.tls is None:
            return conn
        conn.settimeout(TLS_HANDSHAKE_S)
        wrapped = self.tls.wrap_socket(conn, server_side=True)
        wrapped.settimeout(None)
        return wrapped

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            conn = self._handshake(raw)
            while not self._stop.is_set():
                try:
                    head = _recv_exact(conn, _HEAD.size)
                except (PeerUnavailable, OSError):
                    return
                self._answer(conn, head)
        except (OSError, TransferError) as e:
            log.debug("tcp connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(raw)
            conn.close()
            raw.close()
            self._slots.release()

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        magic, version, op, _, count, req_id = _HEAD.unpack(head)
        if (
            magic != MAGIC
            or version != VERSION
            or op != OP_READ
            or count > (SEGMENTS_PER_REQUEST_MAX)
        ):
            self._refuse(
                conn,
                STATUS_BAD_REQUEST,
                count,
                req_id,
                "not a kvdir tcp read request of this version",
            )
            raise TransferError("protocol error")  # the stream is out of sync: hang up
        segs = _recv_exact(conn, _SEG.size * count)
        total = sum(length for _, _, length in _SEG.iter_unpack(segs))
        if total > REQUEST_BYTES_MAX:
            self._refuse(
                conn,
                STATUS_BAD_REQUEST,
                count,
                req_id,
                f"a request of {total} bytes is over the limit of {REQUEST_BYTES_MAX}",
            )
            return
        views = []
        try:
            for addr, rkey, length in _SEG.iter_unpack(segs):
                views.append(self.registry.resolve(addr, rkey, length))
        except AccessDenied as e:
            self.denied += 1
            self._refuse(conn, STATUS_DENIED, count, req_id, str(e))
            return
        conn.settimeout(SEND_STALL_S)  # a reader that stops reading is cut off
        try:
            conn.sendall(_HEAD.pack(MAGIC, VERSION, STATUS_OK, 0, count, req_id))
            for v in views:
                conn.sendall(v)
                self.bytes_served += len(v)
        finally:
            conn.settimeout(None)

    @staticmethod
    def _refuse(conn: socket.socket, status: int, count: int, req_id: int, why: str) -> None:
        msg = why.encode()[:4096]
        conn.sendall(
            _HEAD.pack(MAGIC, VERSION, status, 0, count, req_id) + _U32.pack(len(msg)) + msg
        )

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class TcpChannel(Channel):
    """Reader side: batched, pipelined reads from one holder."""

    def __init__(
        self, endpoint: str, connect_timeout_s: float = 2.0, tls: ssl.SSLContext | None = None
    ) -> None:
        host, _, port = endpoint.rpartition(":")
        self.endpoint = (host, int(port))
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                s = socket.create_connection(self.endpoint, timeout=self.connect_timeout_s)
            except OSError as e:
                raise PeerUnavailable(f"cannot connect to {self.endpoint}: {e}") from e
            try:
                _tune(s)
                if self.tls is not None:
                    # A failed handshake closes the socket it was given.
                    s = self.tls.wrap_socket(s, server_hostname=self.endpoint[0])
            except OSError as e:  # ssl.SSLError included: a refused certificate
                s.close()
                raise PeerUnavailable(f"cannot connect to {self.endpoint}: {e}") from e
            self._sock = s
        return self._sock

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        check_destination(reads, len(dst))
        batches = _split(coalesce(reads))
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                return self._pipeline(batches, dst, deadline)
            except (OSError, TransferError) as e:
                self._drop()  # the stream may be mid-response: start clean next time
                if isinstance(e, TransferError):
                    raise
                raise PeerUnavailable(f"tcp read from {self.endpoint} failed: {e}") from e

    def _pipeline(self, batches: list[list[Read]], dst: memoryview, deadline: float) -> int:
        sock = self._connect()
        pending: deque[tuple[int, list[Read]]] = deque()
        moved = 0
        i = 0
        while i < len(batches) or pending:
            while i < len(batches) and len(pending) < REQUESTS_INFLIGHT_MAX:
                rid = self._next_id
                self._next_id += 1
                self._settimeout(sock, deadline)
                sock.sendall(_request(rid, batches[i]))
                pending.append((rid, batches[i]))
                i += 1
            rid, batch = pending.popleft()
            self._settimeout(sock, deadline)
            moved += self._receive(sock, rid, batch, dst)
        return moved

    @staticmethod
    def _settimeout(sock: socket.socket, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("read deadline passed")
        sock.settimeout(left)

    def _receive(self, sock: socket.socket, rid: int, batch: list[Read], dst: memoryview) -> int:
        magic, version, status, _, count, got_id = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
        if magic != MAGIC or version != VERSION or got_id != rid or count != len(batch):
            raise TransferError("tcp response out of sync")
        if status != STATUS_OK:
            (n,) = _U32.unpack(_recv_exact(sock, 4))
            why = _recv_exact(sock, n).decode(errors="replace")
            if status == STATUS_DENIED:
                raise AccessDenied(why)
            raise TransferError(why)
        moved = 0
        for r in batch:
            _recv_into(sock, dst[r.dst_offset : r.dst_offset + r.length])
            moved += r.length
        return moved

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def _request(rid: int, batch: list[Read]) -> bytes:
    parts = [_HEAD.pack(MAGIC, VERSION, OP_READ, 0, len(batch), rid)]
    parts.extend(_SEG.pack(r.remote_address, r.rkey, r.length) for r in batch)
    return b"".join(parts)


def _split(reads: list[Read]) -> list[list[Read]]:
    """Requests of at most SEGMENTS_PER_REQUEST_MAX segments and ~REQUEST_BYTES_MAX bytes."""
    out: list[list[Read]] = []
    cur: list[Read] = []
    size = 0
    for r in reads:
        # A long coalesced read is cut so one request never pins more than the cap.
        pos = 0
        while pos < r.length:
            n = min(r.length - pos, REQUEST_BYTES_MAX)
            if cur and (len(cur) >= SEGMENTS_PER_REQUEST_MAX or size + n > REQUEST_BYTES_MAX):
                out.append(cur)
                cur, size = [], 0
            cur.append(Read(r.remote_address + pos, r.rkey, n, r.dst_offset + pos))
            size += n
            pos += n
    if cur:
        out.append(cur)
    return out


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Registry | None = None,
        tls: TcpTls | None = None,
    ) -> None:
        self.registry = registry or Registry()
        self.tls = tls
        self.server = TcpServer(self.registry, host, port, tls.server if tls else None)

    def register(self, memory: memoryview) -> Region:
        return self.registry.register(memory)

    def descriptor(self) -> dict[str, str]:
        out = {"transport": self.name, "endpoint": self.server.address}
        if self.tls is not None:
            out["tls"] = "1"
        return out

    def connect(self, descriptor: dict[str, str]) -> Channel:
        holder_tls = descriptor.get("tls") == "1"
        if holder_tls and self.tls is None:
            raise PeerUnavailable("the holder serves tcp over TLS; this agent has no [tls]")
        if self.tls is not None and not holder_tls:
            raise PeerUnavailable("the holder serves tcp without TLS; refusing to read in clear")
        return TcpChannel(descriptor["endpoint"], tls=self.tls.client if self.tls else None)

    def close(self) -> None:
        self.server.close()
