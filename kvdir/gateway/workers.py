"""Several gateway processes behind one port (`workers = N`, SO_REUSEPORT).

The parent binds nothing: it starts N worker processes and supervises them.
Each worker is a whole gateway (its own event loop, mirror of the directory,
backend pool, in-flight counts, engine-load poller and metrics) listening on
the same `listen` address with SO_REUSEPORT, so the kernel spreads new
connections over them; one Python process is one core at most, and at
500 requests/s of 8k-token prompts one core is what the gateway needs.

Workers are spawned (a fresh interpreter each) rather than forked, so no
thread, event loop or gRPC channel of the parent is copied into them.

Ordering contract:
- a worker reports `ready` on its pipe only after its listening sockets are
  bound, or the reason it could not start; the parent serves (returns from
  `start`) only when every worker is ready, and otherwise stops the others and
  raises `WorkerError` naming the worker and the reason (one line);
- after startup, the death of any worker stops the others and raises
  `WorkerError` (a supervisor such as systemd restarts the whole gateway,
  rather than this process restarting one worker in a crash loop);
- SIGTERM or SIGINT to the parent sends SIGTERM to every worker and waits for
  them (bounded by `STOP_TIMEOUT_S`, then SIGKILL);
- a worker whose parent is gone (its pipe reaches end of file) stops itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from kvdir.core.gc_freeze import freeze_startup
from kvdir.gateway.config import GatewayConfig

log = logging.getLogger("kvdir.gateway")

STARTUP_TIMEOUT_S = 120.0
"""Longest wait for every worker to be listening (tokenizers load, the mirror starts)."""
STOP_TIMEOUT_S = 20.0
"""Longest wait for the workers to stop after SIGTERM before they are killed."""
READY = "ready"
FAILED = "failed"


class WorkerError(RuntimeError):
    """A worker could not start, or died: the gateway stops (the message is one line)."""


@dataclass
class _Worker:
    index: int
    proc: BaseProcess
    conn: Connection
    ready: bool = False

    def describe(self) -> str:
        return f"worker {self.index} (pid {self.proc.pid})"


# ------------------------------------------------------------------ worker side


def worker_main(cfg: GatewayConfig, index: int, log_level: str, conn: Connection) -> None:
    """A worker process's entry point: one gateway until SIGTERM or the parent's end."""
    from kvdir.core import logs
    from kvdir.gateway.server import run_loop

    # Ctrl-C reaches the whole process group; the parent turns it into SIGTERM here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logs.setup(cfg.log_format, log_level, {"component": "gateway", "worker": str(index)})
    try:
        run_loop(lambda: _serve(cfg, index, conn))
    except Exception as e:  # a startup failure: the parent prints it as one line
        with contextlib.suppress(OSError):
            conn.send((FAILED, str(e) or type(e).__name__))
        raise SystemExit(1) from None


async def _serve(cfg: GatewayConfig, index: int, conn: Connection) -> None:
    from kvdir.gateway.server import Gateway

    gw = Gateway(cfg, worker=index)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(conn.fileno(), stop.set)  # the parent never writes: readable = it is gone
    try:
        await gw.start()  # binds the shared port (and this worker's own) or raises
        freeze_startup("gateway")
        conn.send((READY, ""))
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await gw.stop()


# ------------------------------------------------------------------ parent side


@contextlib.contextmanager
def _signals() -> Iterator[socket.socket]:
    """A socket that turns readable on SIGTERM or SIGINT (select-friendly signals)."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    previous_fd = signal.set_wakeup_fd(w.fileno())

    def note(signum: int, frame: FrameType | None) -> None:
        pass  # the wakeup fd carries it

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield r
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(previous_fd)
        r.close()
        w.close()


def _spawn(cfg: GatewayConfig, index: int, log_level: str) -> _Worker:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(
        target=worker_main,
        args=(cfg, index, log_level, child_end),
        name=f"kvdir-gateway-worker-{index}",
        daemon=True,
    )
    proc.start()
    child_end.close()  # so the parent's end reads EOF when the worker dies
    return _Worker(index, proc, parent_end)


def _message(w: _Worker) -> tuple[str, str]:
    """The worker's next message; its death reads as a failure with its exit code."""
    try:
        kind, text = w.conn.recv()
        return str(kind), str(text)
    except (EOFError, OSError):
        w.proc.join(STOP_TIMEOUT_S)
        return FAILED, f"exited with code {w.proc.exitcode}"


def _await_ready(workers: list[_Worker], stop: socket.socket) -> bool:
    """True once every worker listens; False on a stop signal; WorkerError on a failure."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = {w.conn: w for w in workers}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(w.describe() for w in waiting.values())
            raise WorkerError(f"{names} not listening after {STARTUP_TIMEOUT_S:g} s")
        got = wait([*waiting, stop], left)
        if stop in got:
            return False
        for c in got:
            w = waiting.pop(c)  # type: ignore[call-overload]
            kind, text = _message(w)
            if kind != READY:
                raise WorkerError(f"{w.describe()} could not start: {text}")
            w.ready = True
    return True


def _supervise(workers: list[_Worker], stop: socket.socket) -> None:
    """Until a stop signal (return) or a worker's death (WorkerError)."""
    by_sentinel = {w.proc.sentinel: w for w in workers}
    got = wait([*by_sentinel, stop])
    for s in got:
        if s in by_sentinel:
            w = by_sentinel[s]
            raise WorkerError(f"{w.describe()} exited with code {w.proc.exitcode}")


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.is_alive():
            w.proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            log.warning("%s did not stop within %g s; killing it", w.describe(), STOP_TIMEOUT_S)
            w.proc.kill()
            w.proc.join(STOP_TIMEOUT_S)
        w.conn.close()


def serve_workers(cfg: GatewayConfig, log_level: str = "INFO") -> None:
    """Run `cfg.workers` gateway processes on one port until SIGTERM or SIGINT."""
    assert cfg.workers >= 1, cfg.workers
    with _signals() as stop:
        workers: list[_Worker] = []
        try:
            workers = [_spawn(cfg, i, log_level) for i in range(cfg.workers)]
            if _await_ready(workers, stop):
                pids = ", ".join(str(w.proc.pid) for w in workers)
                log.info("gateway: %d workers on %s (pids %s)", len(workers), cfg.listen, pids)
                _supervise(workers, stop)
        finally:
            _stop_all(workers)
