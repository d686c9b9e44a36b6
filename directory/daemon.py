"""Assemble and run one directory replica: Raft, gRPC, health, metrics, leases.

`DirectoryDaemon.start()` returns once the Raft port is bound and the gRPC
server listens; `stop()` hands leadership away first when this replica leads,
so a planned restart costs the cluster no election timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvdir.core.security import (
    ClientSecurity,
    SecurityConfigError,
    ServerSecurity,
    read_raft_password,
)
from kvdir.core.shard_map import ShardMap, ShardMapError
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.directory.admin import AdminService
from kvdir.directory.commands import Command, Result, ShardMapSet
from kvdir.directory.config import DirectoryConfig
from kvdir.directory.consensus.membership import (
    MembershipError,
    lock_data_dir,
    resolve_cluster_id,
)
from kvdir.directory.consensus.port import Consensus, Role
from kvdir.directory.consensus.sync import Durability
from kvdir.directory.consensus.syncobj import RaftConsensus
from kvdir.directory.metrics import DirectoryMetrics
from kvdir.directory.server import (
    SERVICE_NAME,
    Clock,
    DirectoryService,
    EchoService,
    LeaseSweeper,
    WallClock,
)
from kvdir.directory.shard_service import (
    HomeClient,
    MapRefresher,
    ShardGuard,
    init_committer,
    own_table_fetch,
)
from kvdir.directory.shard_view import ShardView
from kvdir.directory.watch import WatchService
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.directory")

HEALTH_INTERVAL_S = 0.1
APPLY_LAG_SERVING_MAX = 1000
"""A replica more than this many entries behind its commit index is catching up."""
HANDOVER_MAX_S = 8.0
"""The longest a stopping leader waits for its successor: deploy/systemd gives a
replica 20 s to stop (TimeoutStopSec), and the gRPC drain and the close follow."""


class StartError(RuntimeError):
    """The replica could not start (port taken, unreadable data dir, ...)."""


class DirectoryDaemon:
    def __init__(self, cfg: DirectoryConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or WallClock()
        self.metrics = DirectoryMetrics()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.consensus: Consensus | None = None
        self.server: grpc.Server | None = None
        self.health = health.HealthServicer()
        self._metrics_server: Any = None
        self._service: DirectoryService | None = None
        self.watch: WatchService | None = None
        self.refresher: MapRefresher | None = None
        self._home_client: HomeClient | None = None

    def _on_role_changed(self, old: Role, new: Role) -> None:
        log.info("raft role changed", extra={"from": int(old), "to": int(new)})

    def _raft_password(self) -> str | None:
        path = self.cfg.auth.raft_password_file
        if not path:
            log.warning(
                "raft traffic is NOT encrypted or authenticated (no [auth] raft_password_file): "
                "anyone who reaches %s can join the log (docs/security.md)",
                self.cfg.raft_address,
            )
            return None
        return read_raft_password(path)

    def _init_map(self) -> ShardMap | None:
        path = self.cfg.shard_map_init
        if not path:
            return None
        try:
            with open(path, encoding="utf-8") as f:
                m = ShardMap.from_json(f.read())
        except (OSError, UnicodeDecodeError, ShardMapError) as e:
            raise StartError(f"shard map file {path}: {e}") from e
        if m.version != 1:
            raise StartError(f"shard map file {path}: the first map is version 1, not {m.version}")
        return m

    def _shard_guard(self, consensus: Consensus, init_map: ShardMap | None) -> ShardGuard:
        """The shard check of this replica, and (when sharded) the thread that follows the map."""
        cfg = self.cfg
        view = ShardView(cfg.group, cfg.sharded)
        if not cfg.sharded:
            return ShardGuard(view, None)
        if view.home:
            fetch = own_table_fetch(consensus)
        else:
            client_security = ClientSecurity.from_config(cfg.tls, cfg.auth)
            self._home_client = HomeClient(cfg.shard_home, client_security)
            fetch = self._home_client.fetch
        init = init_committer(consensus, init_map) if init_map is not None else None
        refresher = MapRefresher(view, fetch, cfg.shard_refresh_ms / 1000, init=init)
        refresher.stop_event = self._stop
        self.refresher = refresher
        if view.home:  # follow its own log at once, not only at the next refresh

            def on_apply(_index: int, _cmd: Command, result: Result) -> None:
                if isinstance(result, ShardMapSet):
                    view.offer(result.shard_map)  # on the consensus thread: O(shards)

            consensus.add_apply_listener(on_apply, lambda _index: refresher.wake())
        return ShardGuard(view, refresher)

    def start(self) -> None:
        cfg = self.cfg
        try:
            security = ServerSecurity(cfg.tls, cfg.auth, f"directory replica {cfg.replica_id}")
            password = self._raft_password()
        except SecurityConfigError as e:
            raise StartError(str(e)) from e
        init_map = self._init_map()
        try:
            self._lock_fd = lock_data_dir(cfg.data_dir)
            cluster_id = resolve_cluster_id(cfg.data_dir, cfg.cluster_id)
        except (MembershipError, OSError) as e:
            raise StartError(str(e)) from e
        try:
            raft = RaftConsensus(
                cfg.raft_address,
                [p.raft_address for p in cfg.peers],
                cfg.data_dir,
                cfg.raft,
                on_role_changed=self._on_role_changed,
                cluster_id=cluster_id,
                join=cfg.join,
                password=password,
                bind_address=cfg.raft_bind_address or cfg.raft_address,
                durability=Durability.parse(cfg.durability),
            )
        except OSError as e:
            raise StartError(f"cannot open data dir {cfg.data_dir}: {e}") from e
        try:
            raft.wait_bound()
        except OSError as e:
            raise StartError(f"cannot bind raft address {cfg.raft_address}") from e
        self.consensus = consensus = raft
        service = DirectoryService(cfg, consensus, self.metrics, self.clock)
        service.shards = self._shard_guard(consensus, init_map)
        self._service = service
        self.watch = watch = WatchService(consensus, cfg.replica_id, cfg.watch)
        watch.attach()
        service.watch = watch
        self._bind_metrics(consensus)
        view = service.shards.view
        self.metrics.bind_shards(cfg.group, lambda: view.version)
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=cfg.grpc_workers, thread_name_prefix="kvdir-grpc"
            ),
            interceptors=[security.interceptor()],
            maximum_concurrent_rpcs=cfg.grpc_workers * 8,
            options=[
                ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_PrefixDirectoryServicer_to_server(service, server)
        admin = AdminService(
            cfg, consensus, service.leader_grpc, service.label, cluster_id, service.shards.view
        )
        pb_grpc.add_DirectoryAdminServicer_to_server(admin, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin_name = pb.DESCRIPTOR.services_by_name["DirectoryAdmin"].full_name
        names = [SERVICE_NAME, admin_name, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if cfg.enable_echo:
            pb_grpc.add_EchoServicer_to_server(EchoService(), server)
            names.append(pb.DESCRIPTOR.services_by_name["Echo"].full_name)
        reflection.enable_server_reflection(names, server)
        try:
            security.add_port(server, cfg.grpc_address)
        except RuntimeError as e:
            consensus.close()
            raise StartError(f"cannot listen on gRPC address {cfg.grpc_address}") from e
        server.start()
        self.server = server
        if cfg.metrics_address:
            host, _, port = cfg.metrics_address.rpartition(":")
            try:
                self._metrics_server, _ = start_http_server(int(port), host, self.metrics.registry)
            except OSError as e:
                self.stop()
                raise StartError(f"cannot serve metrics on {cfg.metrics_address}: {e}") from e
        sweeper = LeaseSweeper(
            consensus,
            self.clock,
            cfg.lease_sweep_ms,
            self.metrics,
            cfg.limits.write_timeout_ms / 1000,
        )
        sweeper.stop = self._stop
        loops = [("kvdir-health", self._health_loop), ("kvdir-leases", sweeper.run)]
        if self.refresher is not None:
            loops.append(("kvdir-shard-map", self.refresher.run))
        for name, target in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "directory replica started",
            extra={
                "replica_id": cfg.replica_id,
                "raft": cfg.raft_address,
                "grpc": cfg.grpc_address,
                "metrics": cfg.metrics_address,
                "peers": [p.replica_id for p in cfg.peers],
                "members": consensus.member_addresses(),
                "cluster_id": cluster_id,
                "group": cfg.group,
                "sharded": cfg.sharded,
            },
        )

    def _bind_metrics(self, c: Consensus) -> None:
        self.metrics.bind(
            role=lambda: int(c.status().role),
            term=lambda: c.status().term,
            commit_index=lambda: c.status().commit_index,
            applied_index=lambda: c.status().applied_index,
            has_leader=lambda: 0 if c.status().leader is None else 1,
            entries=lambda: c.read(lambda t: t.entries),
            nodes=lambda: c.read(lambda t: len(t.nodes)),
            namespaces=lambda: c.read(lambda t: len(t.ns_names)),
        )

    def _serving(self) -> bool:
        if self.consensus is None:
            return False
        st = self.consensus.status()
        return st.leader is not None and st.lag <= APPLY_LAG_SERVING_MAX

    def _health_loop(self) -> None:
        last: bool | None = None
        while not self._stop.wait(HEALTH_INTERVAL_S):
            if self._service is not None:
                self._service.observe_catch_up()  # lifts the local-read gate once
            serving = self._serving()
            if serving != last:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                self.health.set("", status)
                self.health.set(SERVICE_NAME, status)
                last = serving

    def stop(self, grace_s: float = 2.0) -> None:
        """Leave gracefully: stop serving, hand over leadership, close."""
        self._stop.set()
        if self.refresher is not None:
            self.refresher.stop()
        if self.watch is not None:
            self.watch.hub.stop()  # ends every Watch stream (they resume elsewhere)
        self.health.enter_graceful_shutdown()
        c = self.consensus
        if c is not None and c.is_leader():
            t0 = time.monotonic()
            timing = self.cfg.raft
            # A handover is one election run at once: it needs about as long as the
            # configured election timeout allows for a vote round (seconds on a
            # starved or emulated host, where operators raise that timeout), never
            # less than 1 s, and never past HANDOVER_MAX_S: the unit's stop timeout
            # must still cover the server's drain.
            deadline = t0 + min(HANDOVER_MAX_S, max(1.0, timing.election_max_s))
            retry_s = max(timing.election_min_s, 0.1)
            next_try = t0
            while c.is_leader() and time.monotonic() < deadline:
                if time.monotonic() >= next_try:
                    # Again when refused: pysyncobj declines a target that is
                    # not caught up yet, and a write may have just landed.
                    c.transfer_leadership()
                    next_try = time.monotonic() + retry_s
                time.sleep(0.01)
            # Operators (and the systemd VM test) read this to tell a handover
            # from a plain exit that left the others to an election timeout.
            log.info(
                "leadership handed over" if not c.is_leader() else "leadership handover timed out",
                extra={
                    "replica_id": self.cfg.replica_id,
                    "seconds": round(time.monotonic() - t0, 3),
                },
            )
        if self.server is not None:
            self.server.stop(grace_s).wait(grace_s)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if c is not None:
            c.close()
        if self._home_client is not None:
            self._home_client.close()
        log.info("directory replica stopped", extra={"replica_id": self.cfg.replica_id})

    def wait(self) -> None:
        self._stop.wait()
