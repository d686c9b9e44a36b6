"""Assemble the event ingestion of the agent's `[[engines]]` (see agent/daemon.py).

Per engine: one `IndexHolders` and one `RankConsumer` per DP rank, plus the
startup hash self-test: the first checkable BlockStored events of each rank
are recomputed from their tokens (agent/events/selfcheck.py); a mismatch is
logged as an error and counted, since it means lookups will never hit.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from kvdir.agent.config import EngineConfig
from kvdir.agent.events.consumer import RankConsumer, offset_endpoint
from kvdir.agent.events.decode import Batch, BlockStored
from kvdir.agent.events.hashes import HashFormat
from kvdir.agent.events.holders import IndexHolders
from kvdir.agent.events.selfcheck import SelfCheckError, check_event
from kvdir.agent.publisher import NodeIdentity, PublisherLimits
from kvdir.core.sharded_client import AnyDirectoryClient

log = logging.getLogger("kvdir.agent.events")

HASH_CHECKS_PER_ENGINE = 8


@dataclass
class HashCheckStats:
    passed: int = 0
    failed: int = 0
    last_message: str = ""


class HashSelfTest:
    """Checks the first `HASH_CHECKS_PER_ENGINE` checkable BlockStored events."""

    def __init__(self, engine: EngineConfig) -> None:
        self.engine = engine
        self.stats = HashCheckStats()
        self._lock = threading.Lock()

    def __call__(self, batch: Batch) -> None:
        if self.stats.passed + self.stats.failed >= HASH_CHECKS_PER_ENGINE:
            return
        for ev in batch.events:
            if type(ev) is not BlockStored:
                continue
            e = self.engine
            try:
                result = check_event(ev, e.hash_algo, e.hash_seed, e.block_tokens)
            except SelfCheckError as err:
                self._record(False, str(err))
                return
            if result is not None:
                self._record(result.ok, result.message)

    def _record(self, ok: bool, message: str) -> None:
        with self._lock:
            if ok:
                self.stats.passed += 1
            else:
                self.stats.failed += 1
            first_failure = not ok and self.stats.failed == 1
            self.stats.last_message = message
        if first_failure:
            log.error(message, extra={"engine": self.engine.name})
        elif ok and self.stats.passed == 1:
            log.info("hash self-test passed", extra={"engine": self.engine.name})


class EngineIngest:
    """One engine's consumers and holders."""

    def __init__(
        self,
        cfg: EngineConfig,
        client: AnyDirectoryClient,
        node: NodeIdentity,
        limits: PublisherLimits | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.holders = IndexHolders(
            client,
            node,
            cfg.name,
            cfg.namespace(),
            HashFormat(cfg.hash_format),
            cfg.kv_group,
            limits,
        )
        self.selftest = HashSelfTest(cfg) if cfg.hash_algo else None
        self.consumers = [
            RankConsumer(
                self.holders,
                rank,
                offset_endpoint(cfg.endpoint, rank),
                offset_endpoint(cfg.replay_endpoint, rank),
                bind=cfg.bind,
                topic=cfg.topic,
                replay_timeout_s=cfg.replay_timeout_ms / 1000,
                context=context,
                observer=self.selftest,
            )
            for rank in range(cfg.dp_rank_start, cfg.dp_rank_start + cfg.dp_size)
        ]

    def start(self) -> None:
        """Register each rank's holder (raises DirectoryError), then subscribe."""
        for c in self.consumers:
            self.holders.holder(c.rank)
        for c in self.consumers:
            c.start()
        log.info(
            "consuming engine KV events",
            extra={
                "engine": self.cfg.name,
                "endpoints": [c.bound_endpoint for c in self.consumers],
                "holders": self.holders.holder_ids(),
            },
        )

    def stop(self, deregister: bool = True) -> None:
        for c in self.consumers:
            c.stop()
        self.holders.stop(deregister=deregister)
