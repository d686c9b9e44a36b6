"""The engine's lookups over a plain Unix socket, beside its gRPC service.

The connector's scheduler side asks its agent once per new request (vLLM
waits for the answer before it schedules the request). Over gRPC that costs
the agent about 1.1 ms of CPU per 500-block lookup on the 2-core host, most
of it in gRPC's own layers (py-spy: the mirror lookup and the ticket are
about a third of the Python time, and most of the CPU is gRPC's C core
threads), and 1.4 ms of latency. This socket answers the same
EngineLookupRequest with the same EngineLookupResponse (`EngineService.answer_lookup`)
in length-prefixed frames on a connection the engine keeps open: the agent
reads, answers and writes on one thread per connection, with no hand-off.

The worker's Fetch (a load's peer part, on the engine's thread for a same-host
load) goes over the same connections: over gRPC its round trip cost ~2.5 ms
beyond the agent's own work for a 512-block fetch on the H200 (the request
carries the chain, the slots and the ticket), which a frame does not pay.

Frames, little-endian:

- request: u32 header (the method in its top 4 bits, FRAME_LOOKUP or
  FRAME_FETCH; the body's length in the rest), then an EngineLookupRequest
  or a FetchRequest;
- answer: u8 status (a gRPC status code number: 0 OK, 3 INVALID_ARGUMENT,
  9 FAILED_PRECONDITION, 13 INTERNAL), u32 length, then the method's
  response (OK) or the refusal's message in UTF-8.

Bounds: at most CONNECTIONS_MAX connections (one more is closed at once: the
engine then asks over gRPC); a request of more than FRAME_BYTES_MAX is
answered INVALID_ARGUMENT and its connection closed (the stream cannot be
resynchronised); once a frame's first byte arrived, no read of the rest may
wait more than FRAME_TIMEOUT_S. A request that does not parse is refused, the connection
kept. The socket file is the engine socket's path plus LOOKUP_SOCKET_SUFFIX
(kvdir/core/wire.py, with the frame headers), with the same permissions; when
that path is too long for a Unix socket there is none, and engines ask over
gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvdir.agent.service import Refusal
from kvdir.core.wire import (
    FRAME_FETCH,
    FRAME_LENGTH_MASK,
    FRAME_LOOKUP,
    FRAME_METHOD_SHIFT,
    FRAME_TOO_LONG,
    FRAME_UNKNOWN_METHOD,
    GRPC_MESSAGE_BYTES_MAX,
    LOOKUP_ANSWER_HEADER,
    LOOKUP_REQUEST_HEADER,
    LOOKUP_SOCKET_SUFFIX,
    recv_exactly,
)
from kvdir.v1 import agent_pb2 as apb

log = logging.getLogger("kvdir.agent")

CONNECTIONS_MAX = 64
"""Engines keep one connection per lookup thread (2 each in the vLLM connector)."""
FRAME_BYTES_MAX = GRPC_MESSAGE_BYTES_MAX
FRAME_TIMEOUT_S = 5.0

Answer = Callable[[apb.EngineLookupRequest], tuple[apb.EngineLookupResponse, str]]
AnswerFetch = Callable[[apb.FetchRequest], apb.FetchResponse]


PATH_BYTES_MAX = 107
"""sockaddr_un's sun_path holds 108 bytes with the terminating NUL."""


def path_of(engine_socket: str) -> str:
    return engine_socket + LOOKUP_SOCKET_SUFFIX


def fits(path: str) -> bool:
    """Whether `path` can name a Unix socket (an engine socket near the limit leaves
    no room for the suffix: the agent then serves lookups over gRPC only)."""
    return len(os.fsencode(path)) <= PATH_BYTES_MAX


class LookupSocket:
    def __init__(
        self,
        path: str,
        answer: Answer,
        mode: int,
        on_refused: Callable[[], None] = lambda: None,
        fetch: AnswerFetch | None = None,
    ) -> None:
        """`on_refused`: called for each connection closed at CONNECTIONS_MAX; `fetch`:
        answers fetch frames (None: they are refused as an unknown method)."""
        self.path = path
        self.answer = answer
        self.fetch = fetch
        self.mode = mode
        self.on_refused = on_refused
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acceptor: threading.Thread | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        os.chmod(self.path, self.mode)
        s.listen(CONNECTIONS_MAX)
        self._listener = s
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="kvdir-lookup-accept", daemon=True
        )
        self._acceptor.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # unblocks each connection's thread (its recv returns b"")
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join(2.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = len(self._conns) >= CONNECTIONS_MAX
                if not full:
                    self._conns.add(conn)
            if full:
                self.on_refused()
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kvdir-lookup-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stopping.is_set():
                if not self._one(conn):
                    return
        except OSError as e:  # ConnectionError among them
            log.debug("lookup socket: connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _one(self, conn: socket.socket) -> bool:
        """Read one request and answer it; False when the connection is to end."""
        conn.settimeout(None)  # an idle connection waits for its next request
        head = recv_exactly(conn, 1)
        if head is None:
            return False
        conn.settimeout(FRAME_TIMEOUT_S)
        rest = recv_exactly(conn, LOOKUP_REQUEST_HEADER.size - 1)
        if rest is None:
            raise ConnectionError("the engine closed mid-frame")
        (header,) = LOOKUP_REQUEST_HEADER.unpack(head + rest)
        method, length = header >> FRAME_METHOD_SHIFT, header & FRAME_LENGTH_MASK
        if length > FRAME_BYTES_MAX:
            self._send(conn, grpc.StatusCode.INVALID_ARGUMENT, f"{FRAME_TOO_LONG}{length} B is "
                       f"over {FRAME_BYTES_MAX} B".encode())  # fmt: skip
            return False
        body = recv_exactly(conn, length) if length else b""
        if body is None:
            return False
        code, payload = self._answer(method, body)
        self._send(conn, code, payload)
        return True

    def _answer(self, method: int, body: bytes) -> tuple[grpc.StatusCode, bytes]:
        try:
            if method == FRAME_LOOKUP:
                what = "an EngineLookupRequest"
                resp: apb.EngineLookupResponse | apb.FetchResponse = self.answer(
                    apb.EngineLookupRequest.FromString(body)
                )[0]
            elif method == FRAME_FETCH and self.fetch is not None:
                what = "a FetchRequest"
                resp = self.fetch(apb.FetchRequest.FromString(body))
            else:  # the body was read whole: the stream stays in step
                return grpc.StatusCode.INVALID_ARGUMENT, f"{FRAME_UNKNOWN_METHOD} {method}".encode()
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"not {what}: {e}".encode()
        except Refusal as e:
            return e.code, str(e).encode()
        except Exception as e:  # the daemon keeps serving; the engine recomputes
            log.exception("lookup socket: the %s failed", "fetch" if method else "lookup")
            return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"[:500].encode()
        return grpc.StatusCode.OK, resp.SerializeToString()

    @staticmethod
    def _send(conn: socket.socket, code: grpc.StatusCode, payload: bytes) -> None:
        conn.sendall(LOOKUP_ANSWER_HEADER.pack(code.value[0], len(payload)) + payload)
