"""Assemble and run a node agent (`kvdir agent serve`, run by systemd per node).

Start order: open (or re-attach) the pools, register them with the transfer
engine (one rkey per pool, shared by every backend), register the node with
the directory under a fresh incarnation and publish what the pools already
hold, then serve peers (TCP) and the local engine (Unix socket). With
`directory_mirror` on, the mirror's Watch stream starts before the servers
(lookups take the RPC path until its first snapshot) and stops after them.

Pool epochs (agent/pool.py): a host pool of an unchanged shape is re-attached
in its epoch (an engine's mapping stays valid); any other shape, and every GPU
tier pool (its device slots are new memory), starts a new epoch in a new file.
Once serving, a reaper thread frees the reserved slots of engines that are gone,
every OWNER_CHECK_INTERVAL_S (slots reserved before a restart included: the
owner is in each slot's header).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import start_http_server

from kvdir.agent import lookup_socket
from kvdir.agent.config import AgentConfig
from kvdir.agent.directory_reads import DirectoryReads, MirrorReads, mirror_reads
from kvdir.agent.fetcher import Fetcher, PeerCache
from kvdir.agent.gpu_pool import GpuTier, GpuTierError
from kvdir.agent.lookup_socket import LookupSocket
from kvdir.agent.metrics import AgentMetrics
from kvdir.agent.pool import KvPool
from kvdir.agent.publisher import Holding, NodeIdentity, Publisher, PublisherLimits
from kvdir.agent.service import AgentCore, AgentService, EngineService, PoolState, ns_key
from kvdir.core.client import DirectoryError
from kvdir.core.security import (
    AuthConfig,
    ClientSecurity,
    SecurityConfigError,
    ServerSecurity,
    TlsConfig,
    ssl_contexts,
)
from kvdir.core.sharded_client import directory_client
from kvdir.directory.validate import namespace_key
from kvdir.transfer.base import TransferError
from kvdir.transfer.engine import TransferEngine
from kvdir.transfer.tcp import TcpTls
from kvdir.v1 import agent_pb2_grpc as apb_grpc
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.agent")

GRPC_WORKERS = 16
ENGINE_SOCKET_MODE = 0o660
"""The engine socket allocates and frees slots: its owner and group only."""
OWNER_CHECK_INTERVAL_S = 1.0
"""How often the reaper looks for reserved slots of engines that are gone."""


class AgentStartError(RuntimeError):
    pass


class AgentDaemon:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.metrics = AgentMetrics()
        self.pools: dict[str, PoolState] = {}
        self.engine: TransferEngine | None = None
        self.publisher: Publisher | None = None
        self.fetcher: Fetcher | None = None
        self.core: AgentCore | None = None
        try:
            self.security = ClientSecurity.from_config(cfg.tls, cfg.auth)
        except SecurityConfigError as e:
            raise AgentStartError(str(e)) from e
        self.directory = directory_client(
            cfg.directory, cfg.shard_home, timeout_s=5.0, security=self.security
        )
        self.mirror: MirrorReads | None = None
        """The directory mirror (directory_mirror on), set and started by `start`."""
        self.ingests: list[Any] = []
        """EngineIngest of each [[engines]] entry (imported only then: pyzmq, cbor2)."""
        self._servers: list[grpc.Server] = []
        self._lookups: LookupSocket | None = None
        self._metrics_server: Any = None
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None

    def _open_pools(self) -> list[tuple[pb.Namespace, KvPool, int]]:
        out: list[tuple[pb.Namespace, KvPool, int]] = []
        for i, pc in enumerate(self.cfg.pools):
            ns = pc.namespace()
            pool = KvPool.open(
                self.cfg.pool_path(i),
                namespace_key(ns),
                pc.slot_bytes,
                pc.slots,
                fresh=pc.tier == "gpu",  # new device slots: nothing of an old epoch is valid
            )
            out.append((ns, pool, pb.TIER_GPU if pc.tier == "gpu" else pb.TIER_HOST))
        return out

    def _holdings(self) -> list[tuple[pb.Namespace, int, list[Holding]]]:
        out = []
        for st in self.pools.values():
            items: list[Holding] = []
            with st.lock:
                st.index.clear()
                for slot, h in st.pool.stored():
                    st.index[h.block_hash] = slot
                    st.recency[slot] = None  # evictable again after a restart
                    items.append(
                        (
                            h.block_hash,
                            st.block_address(slot),
                            st.pool.geometry.slot_bytes,
                            st.block_rkey,
                            h.generation,
                        )
                    )
            out.append((st.namespace, st.tier, items))
        return out

    def start(self) -> None:
        cfg = self.cfg
        try:
            opened = self._open_pools()
        except OSError as e:
            raise AgentStartError(f"cannot open the KV pool under {cfg.pool_dir}: {e}") from e
        rdma = None
        if "rdma" in cfg.transports:
            from kvdir.agent import rdma_link

            rdma = rdma_link.options(
                cfg.node_id,
                cfg.listen,
                cfg.rdma_device,
                cfg.rdma_port,
                cfg.rdma_gid_index,
                self.metrics.rdma_errors,
                self.security,
            )
        tcp_tls = None
        if cfg.tls.enabled:
            try:
                tcp_tls = TcpTls(*ssl_contexts(cfg.tls))
            except SecurityConfigError as e:
                raise AgentStartError(str(e)) from e
        try:
            self.engine = TransferEngine(
                cfg.transports,
                host=cfg.host,
                shared=[pool.mem for _, pool, _ in opened],
                rdma=rdma,
                tcp_tls=tcp_tls,
            )
        except (ValueError, TransferError) as e:
            raise AgentStartError(f"cannot start the transfer engine: {e}") from e
        for (ns, pool, tier), pc in zip(opened, cfg.pools, strict=True):
            region = self.engine.register(pool.view)
            state = PoolState(ns, pool, region, tier)
            if tier == pb.TIER_GPU:
                self._attach_gpu_tier(state, pc.gpu_device)
            self.pools[ns_key(ns)] = state
        node = NodeIdentity(
            cfg.node_id, cfg.host, cfg.listen, tuple(self.engine.names), cfg.lease_ms
        )
        limits = PublisherLimits(
            pending_max=cfg.publish_pending_max,
            batch_window_s=cfg.publish_batch_window_ms / 1000,
            resync_interval_s=cfg.resync_interval_s,
        )
        self.publisher = Publisher(self.directory, node, self._holdings, limits)
        try:
            self.publisher.start()
        except DirectoryError as e:
            raise AgentStartError(
                f"cannot register with the directory at "
                f"{','.join(cfg.shard_home or cfg.directory)}: {e}"
            ) from e
        p = self.publisher
        self.metrics.bind(
            queue_depth=lambda: p.queue_depth,
            drops=lambda: p.dropped,
            published=lambda: p.published,
            failures=lambda: p.failures,
            publish_seconds=lambda: p.last_publish_s,
        )
        self.fetcher = Fetcher(
            cfg.node_id,
            self._directory_reads(),
            PeerCache(self.engine, cfg.node_id, self.security),
            timeout_s=cfg.fetch_timeout_ms / 1000,
            host=cfg.host,
            rdma_gpu=cfg.rdma_gpu,
        )
        self.core = AgentCore(cfg.node_id, self.pools, self.engine, p, self.fetcher, self.metrics)
        self._serve()
        self._start_reaper()
        self._start_engines(node, limits)
        log.info(
            "agent started",
            extra={
                "node_id": cfg.node_id,
                "incarnation": p.incarnation,
                "listen": cfg.listen,
                "engine": cfg.engine_socket,
                "transports": self.engine.names,
            },
        )

    def _start_reaper(self) -> None:
        core = self.core
        assert core is not None

        def loop() -> None:
            while True:
                try:
                    core.reclaim_dead()
                except Exception:  # the reaper must outlive a bug; slots wait for the next pass
                    log.exception("reclaiming dead engines' slots failed")
                if self._stop_reaper.wait(OWNER_CHECK_INTERVAL_S):
                    return

        self._reaper = threading.Thread(target=loop, name="kvdir-reaper", daemon=True)
        self._reaper.start()

    def _directory_reads(self) -> DirectoryReads:
        """The mirror in front of the client (its stream started), or the client alone."""
        self.mirror = mirror_reads(self.cfg, self.directory, self.security)
        if self.mirror is None:
            return self.directory
        self.mirror.start()
        self.metrics.bind_mirror(self.mirror)
        return self.mirror

    def _attach_gpu_tier(self, state: PoolState, device: int) -> None:
        """Give a TIER_GPU pool its device slots, exported through the cuda transport.

        Slots held in the pool file from before a restart are not in the new
        device memory: they are dropped (generation bumped, as a free does)
        before anything is published.
        """
        assert self.engine is not None
        try:
            gpu = GpuTier.open(state.pool, device)
        except GpuTierError as e:
            raise AgentStartError(f"cannot set up the GPU tier: {e}") from e
        state.pool.free([s for s, _ in state.pool.stored()])
        state.gpu = gpu
        state.gpu_rkey = self.engine.register_device(gpu.buffer()).rkey
        if self.cfg.rdma_gpu:
            log.warning("rdma_gpu is on: the remote-GPU path is UNVERIFIED (docs/gpu.md)")

    def _start_engines(self, node: NodeIdentity, limits: PublisherLimits) -> None:
        """Ingest each configured stock engine's KV events (index-only holders)."""
        if not self.cfg.engines:
            return
        import zmq

        from kvdir.agent.events.ingest import EngineIngest
        from kvdir.agent.events.metrics import EventsCollector

        self.metrics.registry.register(EventsCollector(lambda: self.ingests))
        for ec in self.cfg.engines:
            ingest = EngineIngest(ec, self.directory, node, limits)
            self.ingests.append(ingest)
            try:
                ingest.start()
            except DirectoryError as e:
                raise AgentStartError(
                    f"cannot register engine {ec.name}'s holders with the directory: {e}"
                ) from e
            except zmq.ZMQError as e:
                raise AgentStartError(f"cannot subscribe to engine {ec.name}: {e}") from e

    def _serve(self) -> None:
        cfg, core = self.cfg, self.core
        assert core is not None
        try:
            security = ServerSecurity(cfg.tls, cfg.auth, f"agent {cfg.node_id}")
        except SecurityConfigError as e:
            raise AgentStartError(str(e)) from e
        peers = grpc.server(
            futures.ThreadPoolExecutor(GRPC_WORKERS, thread_name_prefix="kvdir-agent"),
            interceptors=[security.interceptor()],
        )
        apb_grpc.add_AgentServicer_to_server(AgentService(core), peers)
        # The engine's socket is local: file permissions guard it, and the
        # interceptor (plain) still answers garbage with INVALID_ARGUMENT.
        local = ServerSecurity(TlsConfig(), AuthConfig(), f"agent {cfg.node_id} engine socket")
        engine = grpc.server(
            futures.ThreadPoolExecutor(GRPC_WORKERS, thread_name_prefix="kvdir-engine"),
            interceptors=[local.interceptor()],
        )
        engine_service = EngineService(core)
        apb_grpc.add_EngineServicer_to_server(engine_service, engine)
        os.makedirs(os.path.dirname(cfg.engine_socket) or ".", exist_ok=True)
        if os.path.exists(cfg.engine_socket):
            os.unlink(cfg.engine_socket)  # a stale socket from a previous run
        try:
            security.add_port(peers, cfg.listen)
            engine.add_insecure_port(f"unix:{cfg.engine_socket}")
        except RuntimeError as e:
            raise AgentStartError(
                f"cannot listen on {cfg.listen} or unix:{cfg.engine_socket}"
            ) from e
        lookups = LookupSocket(
            lookup_socket.path_of(cfg.engine_socket),
            engine_service.answer_lookup,
            ENGINE_SOCKET_MODE,
            core.metrics.lookup_socket_refused.inc,
            engine_service.answer_fetch,
        )
        if lookup_socket.fits(lookups.path):
            try:
                lookups.start()
            except OSError as e:
                raise AgentStartError(f"cannot listen on {lookups.path}: {e}") from e
            self._lookups = lookups
        else:  # engines find no lookup socket and ask over gRPC: slower, not wrong
            log.warning(
                "the engine socket's path leaves no room for its lookup socket (%s: over "
                "%d bytes); engines' lookups go over gRPC",
                lookups.path,
                lookup_socket.PATH_BYTES_MAX,
                extra={"node_id": cfg.node_id},
            )
        peers.start()
        engine.start()
        os.chmod(cfg.engine_socket, ENGINE_SOCKET_MODE)
        self._servers = [peers, engine]
        if cfg.metrics_address:
            host, _, port = cfg.metrics_address.rpartition(":")
            try:
                self._metrics_server, _ = start_http_server(int(port), host, self.metrics.registry)
            except OSError as e:
                raise AgentStartError(f"cannot serve metrics on {cfg.metrics_address}: {e}") from e

    def stop(self, deregister: bool = True) -> None:
        """Leave: stop serving, flush and (by default) withdraw our entries."""
        for ingest in self.ingests:
            ingest.stop(deregister=deregister)
        for s in self._servers:
            s.stop(1.0).wait(2.0)
        if self._lookups is not None:
            self._lookups.stop()
        self._stop_reaper.set()
        if self._reaper is not None:
            self._reaper.join(2.0)
        if self.mirror is not None:
            self.mirror.stop()
        if self.publisher is not None:
            self.publisher.stop(deregister=deregister)
        if self.fetcher is not None:
            self.fetcher.peers.close()
        if self.engine is not None:
            self.engine.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        for st in self.pools.values():
            if st.gpu is not None:
                st.gpu.close()
            st.pool.close()
        self.directory.close()
        log.info("agent stopped", extra={"node_id": self.cfg.node_id})
