"""Directory lookups for the request path: batched, bounded in time, degrading on outage.

Requests that arrive while a `LookupBatch` is in flight are sent together in
the next one (natural batching: no timer, so an idle gateway adds no wait and
a busy one pays one round trip per batch). The call is made with grpc.aio on
the gateway's own event loop (a worker thread would wait for the GIL behind
the loop, up to the 5 ms switch interval), tried on each replica in turn
(any replica answers local reads) under one deadline of `lookup_timeout_ms`.

When a lookup fails the gateway degrades: for `directory_retry_s` every
request is answered `None` at once (routed least-loaded by the caller, and
counted), then one batch tries the directory again. So an outage costs at
most one deadline per retry period, never one per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvdir.core.client import DirectoryError, lookup_request
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.sharded_client import ShardedDirectoryClient
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX, namespace_key
from kvdir.routing.directory_source import prompt_of
from kvdir.routing.policy import Prompt
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.gateway")

QUEUE_MAX = 4096
"""Lookups waiting for a batch; past it a request is routed without one (degraded)."""


class LookupFailed(Exception):
    pass


_Item = tuple[pb.Namespace, list[bytes], "asyncio.Future[Prompt | None]"]


class DirectoryLookups:
    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float,
        retry_s: float,
        batch_max: int,
        on_state: Callable[[bool], None] = lambda up: None,
        clock: Callable[[], float] = time.monotonic,
        security: ClientSecurity = PLAIN,
        sharded: ShardedDirectoryClient | None = None,
    ) -> None:
        """`sharded`: a sharded directory's client; each batch is split, fanned out
        and merged by it (on a thread), `addresses` are then its home's."""
        self._sharded = sharded
        self._addresses = list(addresses)
        self._security = security
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[Any] = []  # aio stubs (the generated types are the sync ones)
        self._preferred = 0
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._batch_max = batch_max
        self._on_state = on_state
        self._clock = clock
        self._down_until = 0.0
        self.up = bool(self._addresses)
        self.reason = "" if self.up else "no directory configured"
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._sharded is not None:
            self._queue = asyncio.Queue(QUEUE_MAX)
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._addresses:
            opts = [
                ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
            ]
            self._channels = [self._security.aio_channel(a, opts) for a in self._addresses]
            self._stubs = [pb_grpc.PrefixDirectoryStub(c) for c in self._channels]
            self._queue = asyncio.Queue(QUEUE_MAX)
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._on_state(self.up)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for c in self._channels:
            await c.close(None)
        if self._sharded is not None:
            self._sharded.close()

    def available(self) -> bool:
        return self._queue is not None and self._clock() >= self._down_until

    async def prompt(self, ns: pb.Namespace, chain: list[bytes]) -> Prompt | None:
        """Who holds `chain`'s prefix; None when the directory can't say in time."""
        if not self.available():
            return None
        assert self._queue is not None
        fut: asyncio.Future[Prompt | None] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((ns, chain, fut))
        except asyncio.QueueFull:
            return None
        return await fut

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if self._clock() < self._down_until:  # queued before the failure was known
                self._resolve_none(batch)
                continue
            try:
                prompts = await self._lookup(batch)
            except LookupFailed as e:
                self._fail(batch, str(e))
                continue
            self._set_state(True, "")
            for (_, _, fut), p in zip(batch, prompts, strict=True):
                if not fut.done():
                    fut.set_result(p)

    async def _lookup(self, batch: list[_Item]) -> list[Prompt]:
        """One LookupBatch per namespace in the batch (a batch is at most `batch_max`)."""
        out: list[Prompt | None] = [None] * len(batch)
        by_ns: dict[str, list[int]] = {}
        for i, (ns, _, _) in enumerate(batch):
            by_ns.setdefault(namespace_key(ns), []).append(i)
        deadline = time.monotonic() + self._timeout_s
        for idx in by_ns.values():
            reqs = [lookup_request(batch[i][0], batch[i][1], omit_records=True) for i in idx]
            resp = await self._call(pb.LookupBatchRequest(lookups=reqs), deadline)
            if len(resp.results) != len(idx):
                raise LookupFailed(f"{len(resp.results)} answers to {len(idx)} lookups")
            for i, r in zip(idx, resp.results, strict=True):
                out[i] = prompt_of(len(batch[i][1]), r)
        return [p for p in out if p is not None]

    async def _call(self, req: pb.LookupBatchRequest, deadline: float) -> pb.LookupBatchResponse:
        """The first replica that answers before the deadline (local reads: any replica)."""
        if self._sharded is not None:
            return await self._call_sharded(req, deadline)
        last = "deadline passed"
        for k in range(len(self._stubs)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            i = (self._preferred + k) % len(self._stubs)
            try:
                resp: pb.LookupBatchResponse = await self._stubs[i].LookupBatch(req, timeout=left)
            except grpc.aio.AioRpcError as e:
                last = f"{self._addresses[i]}: {e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise LookupFailed(last) from None
                continue
            self._preferred = i
            return resp
        raise LookupFailed(f"no directory replica answered: {last}")

    async def _call_sharded(
        self, req: pb.LookupBatchRequest, deadline: float
    ) -> pb.LookupBatchResponse:
        """The sharded client's merged answer (a dead group is a miss, not a failure)."""
        assert self._sharded is not None
        sharded = self._sharded
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(sharded.lookup_batch, list(req.lookups)),
                max(0.0, deadline - time.monotonic()),
            )
        except (DirectoryError, TimeoutError) as e:
            raise LookupFailed(f"the sharded directory did not answer: {e}") from None

    def _fail(self, batch: list[_Item], why: str) -> None:
        self._down_until = self._clock() + self._retry_s
        self._set_state(False, why)
        self._resolve_none(batch)

    @staticmethod
    def _resolve_none(batch: list[_Item]) -> None:
        for _, _, fut in batch:
            if not fut.done():
                fut.set_result(None)

    def _set_state(self, up: bool, why: str) -> None:
        if up != self.up:
            if up:
                log.info("directory reachable again: routing by prefix")
            else:
                log.warning("directory lookups failing (%s): routing least-loaded", why)
            self.up = up
            self.reason = why
            self._on_state(up)
