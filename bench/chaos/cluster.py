"""A directory cluster whose replicas each run in their own network namespace.

The same `kvdir directory serve` processes as `kvdir.local.LocalCluster`,
launched through ``ip netns exec`` (which execs, so the process id is the
replica's own and signals reach it directly). Every replica listens on the
same ports of its own address; the caller must itself run inside a
namespace of the same network to reach them (the run's client namespace).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.chaos.history import Event
from kvdir.local import LocalCluster, Replica

RAFT_PORT = 7001
GRPC_PORT = 7101
METRICS_PORT = 7201


@dataclass
class NetCluster(LocalCluster):
    ips: dict[str, str] = field(default_factory=dict)
    """Replica id -> its address inside its namespace."""
    prefixes: dict[str, list[str]] = field(default_factory=dict)
    """Replica id -> argv prefix entering its namespace."""
    record: Callable[[Event], None] | None = None

    def __post_init__(self) -> None:
        # Off loopback a replica refuses to start without a Raft password (docs/security.md).
        os.makedirs(self.base_dir, exist_ok=True)
        password = os.path.join(self.base_dir, "raft.password")
        fd = os.open(password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        self.extra_args = [*self.extra_args, "--raft-password-file", password]
        for i in range(self.size):
            rid = f"r{i + 1}"
            ip = self.ips[rid]
            d = os.path.join(self.base_dir, rid)
            os.makedirs(d, exist_ok=True)
            self.replicas.append(
                Replica(
                    rid,
                    f"{ip}:{RAFT_PORT}",
                    f"{ip}:{GRPC_PORT}",
                    f"{ip}:{METRICS_PORT}",
                    os.path.join(d, "data"),
                    os.path.join(d, "replica.log"),
                )
            )

    def command(self, r: Replica) -> list[str]:
        return [*self.prefixes[r.replica_id], *super().command(r)]

    def launch(self, r: Replica, command: list[str] | None = None) -> None:
        super().launch(r, command)
        if self.record is not None:
            self.record(Event("replica-start", time.monotonic(), {"replica": r.replica_id}))

    def by_id(self, rid: str) -> Replica:
        return next(r for r in self.replicas if r.replica_id == rid)

    def pause(self, r: Replica) -> None:
        if r.alive:
            assert r.proc is not None
            r.proc.send_signal(signal.SIGSTOP)

    def resume(self, r: Replica) -> None:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for r in self.replicas:
            self.resume(r)  # a stopped process cannot act on SIGTERM
        super().stop()
