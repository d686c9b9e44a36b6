"""A local directory cluster of real replica processes on 127.0.0.1.

Used by `kvdir demo`, the benchmarks and the integration tests: each replica
is a separate `kvdir directory serve` process with its own data dir, so Raft,
gRPC and the journals are exactly what a deployment runs. Every wait here is
on a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvdir.core.client import DirectoryClient, DirectoryError
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.v1 import directory_pb2 as pb

LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    pass


EPHEMERAL_DEFAULT = (32768, 60999)
PORT_FLOOR = 10_000
"""Ports below this are left to services a host may run."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def _pick_range() -> tuple[int, int]:
    """The widest span of ports [lo, hi) outside the kernel's ephemeral range.

    A port from bind(('', 0)) comes from the ephemeral range, the same one every
    outgoing connect() draws its source port from: on a busy host (CI's clusters,
    Raft's reconnects, gRPC channels) another process's connection could take the
    port between our pick and our child's bind, and the child exited with "address
    in use". Ports outside that range are only ever taken by an explicit bind."""
    elo, ehi = _ephemeral_range()
    spans = [(PORT_FLOOR, elo), (ehi + 1, 65536)]
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return (lo, hi) if hi - lo >= 1000 else (elo, ehi + 1)


class _PortCursor:
    """Walks the pick range from a random start, so that two processes picking at
    once (CI runs two test tiers side by side) rarely try the same ports, and one
    process never hands out a port again until it has walked the whole range."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lo, self._hi = _pick_range()
        self._next = self._lo + int.from_bytes(os.urandom(4), "little") % (self._hi - self._lo)

    def take(self, n: int = 1) -> int:
        """The first of `n` consecutive ports, all inside the pick range."""
        with self._lock:
            port = self._next if self._next + n <= self._hi else self._lo
            self._next = self._lo if port + n >= self._hi else port + n
            return port


_CURSOR = _PortCursor()
PORT_PICK_ATTEMPTS = 2000


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago, from outside the
    ephemeral range (see `_pick_range`)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(PORT_PICK_ATTEMPTS):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((LOOPBACK, _CURSOR.take()))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise ClusterError(f"no {n} free loopback ports in {PORT_PICK_ATTEMPTS} tries")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


PORT_RUN_ATTEMPTS = 50


def free_port_run(n: int) -> int:
    """The first of `n` consecutive loopback ports that were all free a moment ago."""
    for _ in range(PORT_RUN_ATTEMPTS):
        base = _CURSOR.take(n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError(f"no {n} consecutive free loopback ports in {PORT_RUN_ATTEMPTS} tries")


LOG_TAIL_BYTES = 4096
LOG_TAIL_LINES = 3


def exited(what: str, returncode: int | None, log_path: str | os.PathLike[str]) -> str:
    """One line: "`what` exited with N" and the last lines of its log (a traceback's
    last is its error). A CI run keeps only its output, so the reason has to be in
    the message, not in a file that is gone by the time anyone reads it."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
        tail = " | ".join([ln for ln in lines if ln][-LOG_TAIL_LINES:]) or "(empty log)"
    except OSError as e:
        tail = f"(no log: {e.strerror})"
    return f"{what} exited with {returncode} ({log_path}): {tail}"


def wait_for(
    cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02
) -> None:
    """Poll `cond` until true; raise ClusterError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Replica:
    replica_id: str
    raft_address: str
    grpc_address: str
    metrics_address: str
    data_dir: str
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    member: bool = True
    """False once removed from the membership: no longer a peer of replicas launched later."""
    extra_args: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    """N replicas under `base_dir`; `start()` waits until one leads."""

    base_dir: str
    size: int = 3
    enable_echo: bool = False
    extra_args: list[str] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    security: ClientSecurity = PLAIN
    """How this harness's own clients reach the replicas (TLS clusters: tests/security)."""

    def __post_init__(self) -> None:
        for _ in range(self.size):
            self._new_replica()

    def _new_replica(self) -> Replica:
        raft, grpc_port, metrics = free_ports(3)
        rid = f"r{len(self.replicas) + 1}"
        d = os.path.join(self.base_dir, rid)
        os.makedirs(d, exist_ok=True)
        r = Replica(
            rid,
            f"{LOOPBACK}:{raft}",
            f"{LOOPBACK}:{grpc_port}",
            f"{LOOPBACK}:{metrics}",
            os.path.join(d, "data"),
            os.path.join(d, "replica.log"),
        )
        self.replicas.append(r)
        return r

    def new_replica(self) -> Replica:
        """Ports and a data dir for one more replica (not launched, not yet a member).

        Launch it after `kvdir ctl add-replica` made it a member; its peers are
        every replica that is still a member.
        """
        r = self._new_replica()
        self.size += 1
        return r

    def mark_removed(self, r: Replica) -> None:
        """Record that `r` left the membership (after `kvdir ctl remove-replica`)."""
        r.member = False
        self.size -= 1

    @property
    def grpc_addresses(self) -> list[str]:
        return [r.grpc_address for r in self.replicas]

    def command(self, r: Replica) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "kvdir.cli",
            "directory",
            "serve",
            "--replica-id",
            r.replica_id,
            "--raft",
            r.raft_address,
            "--grpc",
            r.grpc_address,
            "--metrics",
            r.metrics_address,
            "--data-dir",
            r.data_dir,
        ]
        for p in self.replicas:
            if p is not r and p.member:
                cmd += ["--peer", f"{p.replica_id}={p.raft_address},{p.grpc_address}"]
        if self.enable_echo:
            cmd.append("--enable-echo")
        return cmd + self.extra_args + r.extra_args

    def launch(self, r: Replica, command: list[str] | None = None) -> None:
        """Start `r` (with `command` instead of `self.command(r)`, e.g. a stale config)."""
        with open(r.log_path, "ab") as log:
            r.proc = subprocess.Popen(
                command or self.command(r),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self, timeout_s: float = 30.0) -> None:
        for r in self.replicas:
            if r.member:
                self.launch(r)
        self.wait_leader(timeout_s)

    def client(self, timeout_s: float = 5.0) -> DirectoryClient:
        return DirectoryClient(self.grpc_addresses, timeout_s=timeout_s, security=self.security)

    def statuses(self) -> dict[str, pb.ClusterStatusResponse]:
        """Status of each live replica that answers right now."""
        out = {}
        with DirectoryClient(self.grpc_addresses, timeout_s=0.5, security=self.security) as c:
            for r in self.replicas:
                if not r.alive:
                    continue
                with contextlib.suppress(DirectoryError):
                    out[r.replica_id] = c.status(r.grpc_address)
        return out

    def leader(self) -> Replica | None:
        """The live replica that says it leads (and that its peers agree on)."""
        st = self.statuses()
        leaders = [rid for rid, s in st.items() if s.role == pb.ROLE_LEADER]
        if len(leaders) != 1:
            return None
        agreed = sum(1 for s in st.values() if s.leader_id == leaders[0])
        if agreed * 2 <= self.size:
            return None
        return next(r for r in self.replicas if r.replica_id == leaders[0])

    def wait_leader(self, timeout_s: float = 30.0) -> Replica:
        found: list[Replica] = []

        def has_leader() -> bool:
            for r in self.replicas:
                if (
                    r.proc is not None
                    and r.proc.poll() is not None
                    and r.proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM)
                ):
                    raise ClusterError(
                        exited(f"replica {r.replica_id}", r.proc.returncode, r.log_path)
                    )
            leader = self.leader()
            if leader is not None:
                found.append(leader)
            return leader is not None

        wait_for(has_leader, timeout_s, "a leader that a majority agrees on", 0.05)
        return found[-1]

    def kill(self, r: Replica, sig: int = signal.SIGKILL) -> None:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                r.proc.wait(timeout=10)

    def stop(self) -> None:
        self.signal_stop()
        self.wait_stopped()

    def signal_stop(self) -> None:
        """SIGTERM to every live replica (each hands over, drains, exits on its own)."""
        for r in self.replicas:
            if r.alive:
                assert r.proc is not None
                r.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        """Wait for `signal_stop`'s replicas to exit; SIGKILL any still up after 10 s."""
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ShardedCluster:
    """`groups` Raft groups of `size` replicas each behind one shard map
    (docs/sharding.md): group "g0" holds the map and starts with an even one
    (`shards_per_group` shards per group); every replica follows it."""

    base_dir: str
    groups: int = 2
    size: int = 3
    shards_per_group: int = 1
    refresh_ms: int = 1000
    extra_args: list[str] = field(default_factory=list)
    security: ClientSecurity = PLAIN
    clusters: dict[str, LocalCluster] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvdir.core.shard_map import Group, even_map

        for i in range(self.groups):
            gid = f"g{i}"
            self.clusters[gid] = LocalCluster(
                os.path.join(self.base_dir, gid), self.size, security=self.security
            )
        groups = [Group(gid, tuple(c.grpc_addresses)) for gid, c in self.clusters.items()]
        self.initial_map = even_map(groups, self.shards_per_group)
        self.map_path = os.path.join(self.base_dir, "shard-map.json")
        with open(self.map_path, "w", encoding="utf-8") as f:
            f.write(self.initial_map.to_json())
        home = ",".join(self.home.grpc_addresses)
        for gid, c in self.clusters.items():
            c.extra_args = [
                *self.extra_args,
                "--group",
                gid,
                "--shard-home",
                home,
                "--shard-refresh-ms",
                str(self.refresh_ms),
            ]
            if gid == "g0":
                c.extra_args += ["--shard-map-init", self.map_path]

    @property
    def home(self) -> LocalCluster:
        return self.clusters["g0"]

    def start(self, timeout_s: float = 60.0) -> None:
        """Every replica launched, a leader in every group, the first map everywhere."""
        for c in self.clusters.values():
            for r in c.replicas:
                if r.member:
                    c.launch(r)
        deadline = time.monotonic() + timeout_s
        for c in self.clusters.values():
            c.wait_leader(max(1.0, deadline - time.monotonic()))
        self.wait_map_version(1, max(1.0, deadline - time.monotonic()))

    def map_versions(self) -> dict[str, int]:
        """Each live replica's shard map version ("g1/r2" -> version), as it reports it."""
        return {
            f"{gid}/{rid}": st.shard_map_version
            for gid, c in self.clusters.items()
            for rid, st in c.statuses().items()
        }

    def wait_map_version(self, version: int, timeout_s: float = 30.0) -> None:
        """Until every live replica of every group routes by `version` or newer."""
        last: list[dict[str, int]] = [{}]

        def everywhere() -> bool:
            last[0] = self.map_versions()
            alive = sum(1 for c in self.clusters.values() for r in c.replicas if r.alive)
            return len(last[0]) == alive and all(v >= version for v in last[0].values())

        try:
            wait_for(everywhere, timeout_s, f"shard map v{version} on every replica", 0.05)
        except ClusterError as e:
            raise ClusterError(f"{e} (versions: {last[0]})") from None

    def stop(self) -> None:
        # Every group at once: one group's stop is seconds (each leader's handover,
        # each server's drain), and in turn they added up.
        for c in self.clusters.values():
            c.signal_stop()
        for c in self.clusters.values():
            c.wait_stopped()

    def __enter__(self) -> ShardedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalAgent:
    """One `kvdir agent serve` process on 127.0.0.1 with its own pool file."""

    node_id: str
    base_dir: str
    directory: list[str]
    pool: str
    """`--pool` spec, e.g. "model=m,block_tokens=16,slot_bytes=65536,slots=256"."""
    transports: str = "tcp,shm"
    lease_ms: int = 2000
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    host: str = LOOPBACK
    """The address it publishes (another loopback address makes it "another host"
    to its peers' holder choice, while it still listens on 127.0.0.1)."""

    def __post_init__(self) -> None:
        d = os.path.join(self.base_dir, self.node_id)
        os.makedirs(d, exist_ok=True)
        listen, metrics = free_ports(2)
        self.listen = f"{LOOPBACK}:{listen}"
        self.metrics_address = f"{LOOPBACK}:{metrics}"
        self.engine_socket = os.path.join(d, "agent.sock")
        self.pool_dir = d
        self.log_path = os.path.join(d, "agent.log")

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvdir.cli",
            "agent",
            "serve",
            "--node-id",
            self.node_id,
            "--host",
            self.host,
            "--directory",
            ",".join(self.directory),
            "--listen",
            self.listen,
            "--engine-socket",
            self.engine_socket,
            "--metrics",
            self.metrics_address,
            "--transports",
            self.transports,
            "--lease-ms",
            str(self.lease_ms),
            "--pool-dir",
            self.pool_dir,
            "--pool",
            self.pool,
            *self.extra_args,
        ]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self, timeout_s: float = 30.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        import grpc

        from kvdir.v1 import agent_pb2 as apb
        from kvdir.v1 import agent_pb2_grpc as apb_grpc

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(
                    exited(f"agent {self.node_id}", self.proc.returncode, self.log_path)
                )
            with grpc.insecure_channel(f"unix:{self.engine_socket}") as ch:
                try:
                    apb_grpc.EngineStub(ch).Attach(apb.AttachRequest(), timeout=0.5)
                    return True
                except grpc.RpcError:
                    return False

        wait_for(ready, timeout_s, f"agent {self.node_id} to serve its engine socket", 0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=15)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def wait_agent_sees(
    engine_socket: str,
    ns: pb.Namespace,
    chain: list[bytes],
    node: str,
    blocks: int,
    timeout_s: float = 60.0,
) -> None:
    """Wait until the agent at `engine_socket` answers its engine's Lookup with peer
    `node` holding at least `blocks` leading blocks of `chain`.

    An agent reads the directory through its own mirror, which follows the replicas
    by a few ms (more on a loaded host): a replica saying a block is held does not
    yet mean every agent's next lookup will. Callers about to make an engine load
    wait on this, not only on the replicas.
    """
    from kvdir.agent.engine.client import EngineClient, EngineError

    last: list[dict[str, int]] = [{}]
    client = EngineClient(engine_socket, timeout_s=5.0)

    def seen() -> bool:
        try:
            resp = client.lookup(ns, chain)
        except EngineError:
            return False
        last[0] = {p.node_id: p.prefix_blocks for p in resp.peers}
        return last[0].get(node, 0) >= blocks

    try:
        wait_for(seen, timeout_s, f"the agent at {engine_socket} to see {node} hold {blocks}", 0.02)
    except ClusterError as e:
        raise ClusterError(f"{e} (it last said {last[0]})") from None
    finally:
        client.close()
