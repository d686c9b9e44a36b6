"""Directory lookups for the request path: batched, bounded in time, degrading on outage.

Requests that arrive while a `LookupBatch` is in flight are sent together in
the next one (natural batching: no timer, so an idle gateway adds no wait and
a busy one pays one round trip per batch). The gRPC call runs on one worker
thread with the client's own failover across replicas, under a deadline of
`lookup_timeout_ms`.

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
from concurrent.futures import ThreadPoolExecutor

from directory.client import DirectoryClient, DirectoryError
from kvdir.routing.directory_source import DirectorySource
from kvdir.routing.policy import Prompt
from proto.kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.gateway")

QUEUE_MAX = 4096
"""Lookups waiting for a batch; past it a request is routed without one (degraded)."""

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
    ) -> None:
        self._client = DirectoryClient(addresses, timeout_s=timeout_s) if addresses else None
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._batch_max = batch_max
        self._on_state = on_state
        self._clock = clock
        self._down_until = 0.0
        self.up = self._client is not None
        self.reason = "" if self.up else "no directory configured"
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdir-gw-lookup")

    def start(self) -> None:
        if self._client is not None:
            self._queue = asyncio.Queue(QUEUE_MAX)
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._on_state(self.up)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()

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
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if self._clock() < self._down_until:  # queued before the failure was known
                self._resolve_none(batch)
                continue
            try:
                prompts = await loop.run_in_executor(self._pool, self._lookup, batch)
            except (DirectoryError, AssertionError) as e:
                self._fail(batch, str(e))
                continue
            self._set_state(True, "")
            for (_, _, fut), p in zip(batch, prompts, strict=True):
                if not fut.done():
                    fut.set_result(p)

    def _lookup(self, batch: list[_Item]) -> list[Prompt]:
        """One LookupBatch per namespace present in the batch (on the worker thread)."""
        assert self._client is not None
        out: list[Prompt | None] = [None] * len(batch)
        by_ns: dict[bytes, list[int]] = {}
        for i, (ns, _, _) in enumerate(batch):
            by_ns.setdefault(ns.SerializeToString(deterministic=True), []).append(i)
        for idx in by_ns.values():
            source = DirectorySource(self._client, batch[idx[0]][0], batch_max=self._batch_max)
            for i, p in zip(idx, source.prompts([batch[i][1] for i in idx]), strict=True):
                out[i] = p
        return [p for p in out if p is not None]

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
