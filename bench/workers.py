"""Client load generators: long-lived worker processes that call one unary RPC.

Client processes rather than threads, so the benchmark client is not one GIL
competing with the server it measures (it still shares the machine's cores).
Requests are serialized once, up front, and sent as bytes through a generic
`unary_unary` callable; responses are parsed with the real message type. A
task either cycles through its requests for a fixed time (lookups, echo) or
sends each request exactly once, retrying what is safe to retry (publishes).

Workers start with the ``spawn`` method (no gRPC state crosses a fork) and
synchronise on a wall-clock start time so concurrent tasks overlap exactly.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import grpc

from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.v1 import directory_pb2 as pb

_RETRY = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
ATTEMPTS_MAX = 50
"""Tries per request in send-once mode (10 ms apart) before it counts as failed."""


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
            ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
        ],
    )


def raw_method(ch: grpc.Channel, method: str, response: str) -> Any:
    """A callable taking serialized request bytes and returning the parsed response."""
    return ch.unary_unary(
        method,
        request_serializer=None,
        response_deserializer=getattr(pb, response).FromString,
    )


@dataclass(frozen=True, slots=True)
class CallTask:
    address: str
    method: str
    """Full method path, e.g. /kvdir.v1.PrefixDirectory/Lookup."""
    response: str
    """Name of the response message in directory_pb2."""
    requests: list[bytes]
    start_at: float
    """time.time() at which every thread starts calling."""
    duration_s: float
    """> 0: cycle through `requests` this long; 0: send each request once."""
    max_calls: int
    threads: int = 1
    first: int = 0
    """Where in `requests` this task starts cycling (spreads concurrent tasks)."""
    warmup_calls: int = 0
    timeout_s: float = 10.0
    sum_field: str = ""
    """A numeric response field to total (e.g. Publish's `applied`)."""
    pace_s: float = 0.0
    """Send-once mode: request i goes no earlier than `start_at` + i * pace_s (an
    offered rate, not a closed loop: a slow answer does not slow the schedule)."""
    stamp_field: str = ""
    """A numeric response field to record with the time of each answer (`stamps`)."""


@dataclass(slots=True)
class CallResult:
    latencies_ns: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    started: float = 0.0
    finished: float = 0.0
    calls: int = 0
    summed: int = 0
    failed: int = 0
    """Send-once mode: requests that never succeeded."""
    stamps: list[tuple[int, int]] = field(default_factory=list)
    """(stamp_field's value, time.perf_counter_ns() at the answer) per answer: the
    monotonic clock, so comparable with other processes' on this machine."""


def _cycle(call: Any, task: CallTask, t: int, out: CallResult, lock: threading.Lock) -> None:
    reqs, n = task.requests, len(task.requests)
    i = (task.first + t * max(1, n // max(1, task.threads))) % n
    for _ in range(task.warmup_calls):
        with contextlib.suppress(grpc.RpcError):
            call(reqs[i], timeout=task.timeout_s)
        i = (i + 1) % n
    time.sleep(max(0.0, task.start_at - time.time()))
    lat: list[int] = []
    idx: list[int] = []
    errors: dict[str, int] = {}
    summed = 0
    end = time.perf_counter() + task.duration_s
    calls_max = task.max_calls // task.threads
    clock = time.perf_counter_ns
    while len(lat) < calls_max:
        t0 = clock()
        try:
            resp = call(reqs[i], timeout=task.timeout_s)
        except grpc.RpcError as e:
            code = e.code().name
            errors[code] = errors.get(code, 0) + 1
            if sum(errors.values()) > calls_max:
                break
        else:
            lat.append(clock() - t0)
            idx.append(i)
            if task.sum_field:
                summed += getattr(resp, task.sum_field)
        i = (i + 1) % n
        if time.perf_counter() >= end:
            break
    with lock:
        out.latencies_ns += lat
        out.indices += idx
        out.calls += len(lat)
        out.summed += summed
        for k, v in errors.items():
            out.errors[k] = out.errors.get(k, 0) + v


def _once(call: Any, task: CallTask, t: int, out: CallResult, lock: threading.Lock) -> None:
    time.sleep(max(0.0, task.start_at - time.time()))
    base = time.perf_counter()
    lat: list[int] = []
    idx: list[int] = []
    stamps: list[tuple[int, int]] = []
    errors: dict[str, int] = {}
    summed = failed = 0
    clock = time.perf_counter_ns
    for i in range(t, min(len(task.requests), task.max_calls), task.threads):
        if task.pace_s > 0:
            time.sleep(max(0.0, base + i * task.pace_s - time.perf_counter()))
        t0 = clock()
        for attempt in range(ATTEMPTS_MAX):
            try:
                resp = call(task.requests[i], timeout=task.timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                errors[code.name] = errors.get(code.name, 0) + 1
                if code not in _RETRY or attempt == ATTEMPTS_MAX - 1:
                    failed += 1
                    break
                time.sleep(0.01)
            else:
                now = clock()
                lat.append(now - t0)
                idx.append(i)
                if task.sum_field:
                    summed += getattr(resp, task.sum_field)
                if task.stamp_field:
                    stamps.append((getattr(resp, task.stamp_field), now))
                break
    with lock:
        out.latencies_ns += lat
        out.indices += idx
        out.stamps += stamps
        out.calls += len(lat)
        out.summed += summed
        out.failed += failed
        for k, v in errors.items():
            out.errors[k] = out.errors.get(k, 0) + v


def run_task(task: CallTask) -> CallResult:
    """Run `task` in this process (what a worker does with each task it gets)."""
    ch = channel(task.address)
    try:
        grpc.channel_ready_future(ch).result(timeout=max(1.0, task.start_at - time.time() + 5))
        call = raw_method(ch, task.method, task.response)
        out = CallResult()
        lock = threading.Lock()
        body = _cycle if task.duration_s > 0 else _once
        threads = [
            threading.Thread(target=body, args=(call, task, t, out, lock), daemon=True)
            for t in range(task.threads)
        ]
        for th in threads:
            th.start()
        time.sleep(max(0.0, task.start_at - time.time()))
        out.started = time.time()
        for th in threads:
            th.join()
        out.finished = time.time()
        return out
    finally:
        ch.close()


def _serve(conn: Connection) -> None:
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            conn.send(("ok", run_task(task)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class WorkerError(RuntimeError):
    pass


class WorkerPool:
    """`size` spawned client processes; `run` gives task i to worker i."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for i in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child,), name=f"kvdir-bench-client-{i}")
            p.daemon = True
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    @property
    def size(self) -> int:
        return len(self.procs)

    def run(self, tasks: list[CallTask], timeout_s: float) -> list[CallResult]:
        if len(tasks) > self.size:
            raise ValueError(f"{len(tasks)} tasks for {self.size} workers")
        for conn, task in zip(self.conns, tasks, strict=False):
            conn.send(task)
        deadline = time.monotonic() + timeout_s
        results: list[CallResult] = []
        for conn in self.conns[: len(tasks)]:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise WorkerError(f"a client worker gave no result within {timeout_s:.0f}s")
            status, value = conn.recv()
            if status != "ok":
                raise WorkerError(f"client worker failed:\n{value}")
            results.append(value)
        return results

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
