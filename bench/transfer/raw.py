"""The raw baselines of a fetch: a loopback TCP copy between two processes, and memcpy.

`RawSocket` is the receiving half (this process, `recv_into` a preallocated
buffer); `raw_sender` runs in a child process and answers each length with
one `sendall` from a buffer, on two connections: kernel-default socket
buffers and fixed `FIXED_BUFFER_BYTES` ones.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import suppress

from bench.transfer.config import FIXED_BUFFER_BYTES, MIB, BenchError
from kvdir import report
from kvdir.local import LOOPBACK

_U64 = struct.Struct("<Q")


def raw_sender(port: int, max_bytes: int) -> None:
    """Child process of the raw-socket baseline: two connections (kernel-default and
    product-sized socket buffers); each request is a u64 length, answered with that
    many bytes by one `sendall` from a preallocated buffer; length 0 ends."""
    buf = bytearray(max_bytes)
    tile = os.urandom(MIB)
    for pos in range(0, max_bytes, MIB):
        k = min(MIB, max_bytes - pos)
        buf[pos : pos + k] = tile[:k]
    view = memoryview(buf)

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = bytearray(_U64.size)
                got = 0
                while got < _U64.size:
                    k = conn.recv_into(memoryview(head)[got:])
                    if k == 0:
                        return
                    got += k
                (n,) = _U64.unpack(head)
                if n == 0 or n > max_bytes:
                    return
                conn.sendall(view[:n])

    threads = []
    for tuned in (False, True):
        conn = socket.create_connection((LOOPBACK, port), timeout=30)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tuned:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FIXED_BUFFER_BYTES)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FIXED_BUFFER_BYTES)
        conn.sendall(b"T" if tuned else b"D")
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


class RawSocket:
    """The receiving half of the raw-socket baseline (this process)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        listener = socket.create_server((LOOPBACK, 0))
        listener.settimeout(60)
        port = listener.getsockname()[1]
        code = (
            "import sys; from bench.transfer.raw import raw_sender; "
            "raw_sender(int(sys.argv[1]), int(sys.argv[2]))"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(port), str(max_bytes)],
            cwd=str(report.REPO_ROOT),
            start_new_session=True,
        )
        self.conns: dict[str, socket.socket] = {}
        try:
            for _ in range(2):
                conn, _ = listener.accept()
                conn.settimeout(120)
                kind = conn.recv(1)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if kind == b"T":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FIXED_BUFFER_BYTES)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FIXED_BUFFER_BYTES)
                    self.conns["tuned"] = conn
                else:
                    self.conns["default"] = conn
        except OSError as e:
            self.close()
            raise BenchError(f"raw-socket sender did not connect: {e}") from e
        finally:
            listener.close()

    def copy(self, dst: memoryview, kind: str = "default") -> float:
        conn = self.conns[kind]
        n = len(dst)
        t0 = time.perf_counter()
        conn.sendall(_U64.pack(n))
        got = 0
        while got < n:
            k = conn.recv_into(dst[got:], n - got)
            if k == 0:
                raise BenchError("raw-socket sender went away")
            got += k
        return time.perf_counter() - t0

    def close(self) -> None:
        for c in self.conns.values():
            with suppress(OSError):
                c.sendall(_U64.pack(0))
            c.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def memcpy(dst: memoryview, src: memoryview) -> float:
    t0 = time.perf_counter()
    dst[:] = src
    return time.perf_counter() - t0
