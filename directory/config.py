"""Configuration of one directory replica: a TOML file, overridable by flags.

Example (deploy/config/directory.toml has a commented one)::

    replica_id = "r1"
    raft_address = "10.0.0.1:7001"
    grpc_address = "10.0.0.1:7101"
    metrics_address = "10.0.0.1:7201"
    data_dir = "/var/lib/kvdir/r1"

    [[peers]]
    replica_id = "r2"
    raft_address = "10.0.0.2:7001"
    grpc_address = "10.0.0.2:7101"

    [limits]          # directory.limits.RequestLimits fields
    chain_blocks_max = 4096

    [raft]            # directory.consensus.tuning.RaftTuning fields
    election_min_s = 0.15

    [watch]           # directory.limits.WatchLimits fields (the Watch stream's bounds)
    heartbeat_ms = 50

    [tls]             # directory.security.TlsConfig (docs/security.md)
    cert = "/etc/kvdir/tls/r1.crt"
    key = "/etc/kvdir/tls/r1.key"
    ca = "/etc/kvdir/tls/ca.crt"

    [auth]            # directory.security.AuthConfig
    admins = ["kvdir-admin"]
    raft_password_file = "/etc/kvdir/raft.password"
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from kvdir.core.config import ConfigError, read_toml, section, security_sections
from kvdir.core.security import AuthConfig, TlsConfig, is_loopback
from kvdir.directory.consensus.sync import Durability
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.limits import (
    BATCH_ENTRIES_CEILING,
    LEASE_MS_DEFAULT,
    RequestLimits,
    WatchLimits,
)
from kvdir.directory.shard_view import HOME_GROUP

_CLUSTER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Peer:
    replica_id: str
    raft_address: str
    grpc_address: str


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    replica_id: str
    raft_address: str
    grpc_address: str
    data_dir: str
    peers: tuple[Peer, ...] = ()
    metrics_address: str = ""
    lease_default_ms: int = LEASE_MS_DEFAULT
    lease_sweep_ms: int = 250
    enable_echo: bool = False
    grpc_workers: int = 32
    log_format: str = "json"
    cluster_id: str = ""
    """Set by `kvdir directory restore/recover` in the data dir; give it here only to
    join a restored cluster with an empty data dir (docs/operations.md)."""
    join: bool = False
    """Joining a running cluster (`kvdir ctl add-replica`): never campaign before
    hearing from its leader. Only for the first start of an added replica."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    raft: RaftTuning = field(default_factory=RaftTuning)
    watch: WatchLimits = field(default_factory=WatchLimits)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    raft_bind_address: str = ""
    """Where the Raft port listens ("" = raft_address: the cluster network only).
    The Raft library's own default is every interface."""
    durability: str = Durability.POWER_LOSS.value
    """What an acknowledged write survives (docs/directory.md, "Durability
    contract"): "power-loss" (fsync before acknowledging) or the weaker
    "process-crash" (a kernel crash or power loss of a majority may lose about
    the last second of acknowledged writes)."""
    group: str = "g0"
    """This replica's shard group (docs/sharding.md); "g0" holds the shard map."""
    shard_home: tuple[str, ...] = ()
    """gRPC addresses of the home group's replicas. Empty (and no shard_map_init):
    unsharded, today's behaviour: this group owns every key."""
    shard_map_init: str = ""
    """Home group only: a shard map file (JSON, kvdir.core.shard_map) its leader
    commits as the first map when none is committed yet."""
    shard_refresh_ms: int = 1000
    """How often a sharded replica asks the home group for a newer map."""

    @property
    def sharded(self) -> bool:
        return bool(self.shard_home or self.shard_map_init)

    def grpc_of_raft(self) -> dict[str, str]:
        """Raft address -> gRPC address for every member (for leader hints)."""
        out = {p.raft_address: p.grpc_address for p in self.peers}
        out[self.raft_address] = self.grpc_address
        return out

    def replica_of_raft(self) -> dict[str, str]:
        out = {p.raft_address: p.replica_id for p in self.peers}
        out[self.raft_address] = self.replica_id
        return out


def from_dict(raw: dict[str, Any]) -> DirectoryConfig:
    raw = dict(raw)
    peers_raw = raw.pop("peers", [])
    if not isinstance(peers_raw, list):
        raise ConfigError("peers must be an array of tables")
    try:
        peers = tuple(Peer(**p) for p in peers_raw)
    except TypeError as e:
        raise ConfigError(f"bad [[peers]] entry: {e}") from e
    limits = section(RequestLimits, raw.pop("limits", None), "limits")
    tuning = section(RaftTuning, raw.pop("raft", None), "raft")
    watch = section(WatchLimits, raw.pop("watch", None), "watch")
    tls, auth = security_sections(raw)
    names = {f.name for f in dataclasses.fields(DirectoryConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown keys: {', '.join(unknown)}")
    missing = [
        n for n in ("replica_id", "raft_address", "grpc_address", "data_dir") if not raw.get(n)
    ]
    if missing:
        raise ConfigError(f"missing required keys: {', '.join(missing)}")
    if isinstance(raw.get("shard_home"), list | tuple):
        raw["shard_home"] = tuple(str(a) for a in raw["shard_home"])
    elif "shard_home" in raw:
        raise ConfigError("shard_home must be an array of gRPC addresses")
    try:
        cfg = DirectoryConfig(
            peers=peers, limits=limits, raft=tuning, watch=watch, tls=tls, auth=auth, **raw
        )
    except TypeError as e:
        raise ConfigError(str(e)) from e
    _check(cfg)
    ids = [cfg.replica_id, *(p.replica_id for p in peers)]
    if len(set(ids)) != len(ids):
        raise ConfigError("replica ids must be unique")
    return cfg


def _check(cfg: DirectoryConfig) -> None:
    """Refuse values the Raft library would assert on, or that make no sense, with a reason."""
    if not 0 < cfg.limits.batch_entries_max <= BATCH_ENTRIES_CEILING:
        raise ConfigError(f"[limits] batch_entries_max must be 1..{BATCH_ENTRIES_CEILING}")
    t = cfg.raft
    if not 0 < t.append_entries_period_s * 3 < t.election_min_s < t.election_max_s:
        raise ConfigError(
            "[raft] needs 0 < 3 * append_entries_period_s < election_min_s < election_max_s"
        )
    if t.connection_timeout_s < t.election_max_s:
        raise ConfigError("[raft] connection_timeout_s must be >= election_max_s")
    if not (0 < t.tick_period_s <= t.append_entries_period_s and t.keepalive_s > 0):
        raise ConfigError(
            "[raft] needs 0 < tick_period_s <= append_entries_period_s and keepalive_s > 0"
        )
    if t.keepalive_s >= t.connection_timeout_s:
        raise ConfigError("[raft] keepalive_s must be < connection_timeout_s")
    if t.leader_fallback_s <= t.append_entries_period_s:
        raise ConfigError("[raft] leader_fallback_s must be > append_entries_period_s")
    for name in ("compaction_min_entries", "commands_queue_max"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"[raft] {name} must be > 0")
    for f in dataclasses.fields(cfg.limits):
        if getattr(cfg.limits, f.name) <= 0:
            raise ConfigError(f"[limits] {f.name} must be > 0")
    if cfg.limits.lookup_nodes_default > cfg.limits.lookup_nodes_max:
        raise ConfigError("[limits] lookup_nodes_default must be <= lookup_nodes_max")
    w = cfg.watch
    for f in dataclasses.fields(w):
        if getattr(w, f.name) <= 0:
            raise ConfigError(f"[watch] {f.name} must be > 0")
    if w.history_entries_max > w.buffer_entries_max or w.history_bytes_max > w.buffer_bytes_max:
        raise ConfigError("[watch] the history may not hold more than one watcher's buffer")
    exposed = [a for a in (cfg.raft_address, cfg.raft_bind_address) if a and not is_loopback(a)]
    if exposed and not cfg.auth.raft_password_file:
        # pysyncobj unpickles every frame that reaches the Raft port: without the
        # password's encryption, anyone who can connect runs code in the replica.
        raise ConfigError(
            f"raft address {exposed[0]} is not loopback: set [auth] raft_password_file "
            "(--raft-password-file), or anyone who reaches the Raft port can run code "
            "in this replica (docs/security.md)"
        )
    if cfg.cluster_id and not _CLUSTER_ID_RE.match(cfg.cluster_id):
        raise ConfigError("cluster_id must be 1-64 of [A-Za-z0-9_.-]")
    try:
        Durability.parse(cfg.durability)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    _check_shards(cfg)
    if cfg.log_format not in ("json", "text"):
        raise ConfigError("log_format must be 'json' or 'text'")
    if cfg.grpc_workers <= 0 or cfg.lease_sweep_ms <= 0 or cfg.lease_default_ms <= 0:
        raise ConfigError("grpc_workers, lease_sweep_ms and lease_default_ms must be > 0")


def _check_shards(cfg: DirectoryConfig) -> None:
    if not _CLUSTER_ID_RE.match(cfg.group):
        raise ConfigError("group must be 1-64 of [A-Za-z0-9_.-]")
    if cfg.shard_map_init and cfg.group != HOME_GROUP:
        raise ConfigError(
            f"shard_map_init is for the home group {HOME_GROUP!r}, not group {cfg.group!r}"
        )
    if cfg.shard_refresh_ms <= 0:
        raise ConfigError("shard_refresh_ms must be > 0")
    if any(not a or "," in a for a in cfg.shard_home):
        raise ConfigError("shard_home is a list of HOST:PORT gRPC addresses")


def load(path: str, overrides: dict[str, Any] | None = None) -> DirectoryConfig:
    return from_dict(read_toml(path, overrides))


def parse_peer(spec: str) -> Peer:
    """A peer from a flag: ``ID=RAFT_HOST:PORT,GRPC_HOST:PORT``."""
    try:
        rid, addrs = spec.split("=", 1)
        raft, grpc_addr = addrs.split(",", 1)
    except ValueError as e:
        raise ConfigError(f"peer {spec!r} is not ID=RAFT_ADDR,GRPC_ADDR") from e
    return Peer(rid, raft, grpc_addr)
