"""Configuration of a node agent: a TOML file (deploy/config/agent.toml), or flags.

node_id = "node-a"
host = "10.0.1.7"                       # the address peers reach this node on
directory = ["10.0.0.1:7101", "10.0.0.2:7101", "10.0.0.3:7101"]
# shard_home = ["10.0.0.1:7101", ...]   # a sharded directory: its home group g0, instead
                                        # of `directory` (docs/sharding.md)
listen = "10.0.1.7:7301"                # kvdir.v1.Agent for peers
engine_socket = "/run/kvdir/agent.sock" # kvdir.v1.Engine for the local engine (and
                                        # <path>.lookup: its lookups without gRPC)
metrics_address = "10.0.1.7:7302"
transports = ["shm", "tcp"]              # "rdma" (pyverbs; docs/rdma.md), "cuda" (GPU tier)
rdma_device = "mlx5_0"                  # rdma only; default: first device with an active port
rdma_gid_index = 3                      # rdma only; default: first RoCE v2 IPv4-mapped GID
lease_ms = 10000
pool_dir = "/dev/shm"
directory_mirror = true                 # lookups from an in-process mirror (docs/agent.md)
directory_mirror_staleness_ms = 1000    # past this lag (or silence) lookups go over gRPC

[[pools]]                               # one per namespace the engine serves
model = "meta-llama/Llama-3.1-8B"
dtype = "bf16"
block_tokens = 16
layout = "vllm-paged"
slot_bytes = 2097152                    # KV bytes of one block
slots = 4096
tier = "host"                           # or "gpu": slots in GPU memory (needs "cuda"; docs/gpu.md)
gpu_device = 0                          # gpu tier only: the GPU the slots live on

[[engines]]                             # optional: a stock vLLM / SGLang's KV events
name = "vllm0"                          # holders are "<node_id>/vllm0/dp<rank>"
endpoint = "tcp://127.0.0.1:5557"       # the engine's --kv-events-config endpoint
replay_endpoint = "tcp://127.0.0.1:5558"
model = "meta-llama/Llama-3.1-8B"       # the namespace its blocks are indexed in
block_tokens = 16
dp_size = 1                             # one subscription per DP rank (ports + rank)
hash_algo = "sha256"                    # for the hash self-test (docs/events.md)

[tls]                                   # optional: TLS + mTLS (docs/security.md)
cert = "/etc/kvdir/tls/node-a.crt"      # CN = node_id: the identity peers and the
key = "/etc/kvdir/tls/node-a.key"       # directory check; also our client certificate
ca = "/etc/kvdir/tls/ca.crt"

[auth]
token_file = "/etc/kvdir/node-a.token"  # optional bearer token "node-a.<secret>"
tokens_file = "/etc/kvdir/tokens.toml"  # optional: peers' tokens this agent accepts
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvdir.core.config import ConfigError, read_toml, security_sections
from kvdir.core.security import AuthConfig, TlsConfig
from kvdir.core.wire import namespace_key
from kvdir.directory.limits import LEASE_MS_DEFAULT, LEASE_MS_MAX, LEASE_MS_MIN, WatchLimits
from kvdir.v1 import directory_pb2 as pb

POOL_BYTES_MAX = 1 << 40
DIRECTORY_MIRROR_STALENESS_MS_MIN = 100
DIRECTORY_MIRROR_STALENESS_MS_MAX = 60_000
"""Bounds of `directory_mirror_staleness_ms`. Below the minimum an idle stream
(a heartbeat every WatchLimits.heartbeat_ms) would flap between fresh and stale;
above the maximum a mirror cut off from every replica would serve answers
minutes old (safe, but each one a likely miss)."""
assert 2 * WatchLimits().heartbeat_ms <= DIRECTORY_MIRROR_STALENESS_MS_MIN
TRANSPORTS = ("tcp", "shm", "rdma", "cuda")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    model: str
    block_tokens: int
    slot_bytes: int
    slots: int
    dtype: str = ""
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 0
    tier: str = "host"
    gpu_device: int = 0
    """tier "gpu": the CUDA device the agent-owned slots live on."""

    def namespace(self) -> pb.Namespace:
        return pb.Namespace(
            model=self.model,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
            layout=self.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )


ENGINE_KINDS = ("vllm", "sglang")
HASH_FORMATS = ("auto", "u64", "signed", "bytes")
HASH_ALGOS = ("", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DP_SIZE_MAX = 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A stock engine whose KV events the agent ingests (agent/events, docs/events.md)."""

    name: str
    endpoint: str
    model: str
    block_tokens: int
    kind: str = "vllm"
    replay_endpoint: str = ""
    bind: bool = False
    """True when the engine connects to us (its endpoint has no `*`): we bind."""
    topic: str = ""
    dp_size: int = 1
    dp_rank_start: int = 0
    hash_format: str = "auto"
    hash_algo: str = ""
    """The engine's --prefix-caching-hash-algo, for the startup self-test ("" = off)."""
    hash_seed: str = ""
    """The engine's PYTHONHASHSEED ("" = vLLM's default NONE_HASH seed)."""
    kv_group: int = 0
    dtype: str = ""
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 0
    replay_timeout_ms: int = 1000

    def namespace(self) -> pb.Namespace:
        return pb.Namespace(
            model=self.model,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
            layout=self.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_id: str
    host: str
    directory: tuple[str, ...]
    listen: str
    engine_socket: str
    pools: tuple[PoolConfig, ...]
    shard_home: tuple[str, ...] = ()
    """A sharded directory's home group (g0), instead of `directory`: the agent
    follows the shard map it holds, writes to every group and mirrors them all."""
    metrics_address: str = ""
    transports: tuple[str, ...] = ("shm", "tcp")
    lease_ms: int = LEASE_MS_DEFAULT
    pool_dir: str = "/dev/shm"
    fetch_timeout_ms: int = 5000
    log_format: str = "json"
    publish_batch_window_ms: int = 5
    publish_pending_max: int = 65536
    resync_interval_s: float = 300.0
    directory_mirror: bool = True
    """Answer lookups (the fetch path's, the engine's Lookup) from an in-process
    mirror of the directory fed by a Watch stream (agent/directory_reads.py);
    the RPC path serves while the mirror is stale."""
    directory_mirror_staleness_ms: int = 1000
    """Past this lag behind the leader (or silence of the stream) the mirror is stale."""
    rdma_device: str = ""
    rdma_port: int = 0
    rdma_gid_index: int = -1
    rdma_gpu: bool = False
    """UNVERIFIED remote-GPU path (RDMA with dma-buf) in holder choice; off by default."""
    engines: tuple[EngineConfig, ...] = ()
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)

    def pool_path(self, index: int) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.node_id)
        return os.path.join(self.pool_dir, f"kvdir-{safe}-pool{index}")


def from_dict(raw: dict[str, Any]) -> AgentConfig:
    raw = dict(raw)
    pools_raw = raw.pop("pools", [])
    if not isinstance(pools_raw, list) or not pools_raw:
        raise ConfigError("at least one [[pools]] entry is required")
    pools = []
    for i, p in enumerate(pools_raw):
        try:
            pools.append(PoolConfig(**p))
        except TypeError as e:
            raise ConfigError(f"[[pools]] #{i + 1}: {e}") from e
    engines = _engines(raw.pop("engines", []))
    tls, auth = security_sections(raw)
    if auth.raft_password_file or auth.admins:
        raise ConfigError("[auth] raft_password_file and admins are directory settings")
    names = {f.name for f in dataclasses.fields(AgentConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown keys: {', '.join(unknown)}")
    for key in ("directory", "transports", "shard_home"):
        if key in raw:
            value = raw[key]
            items = value.split(",") if isinstance(value, str) else value
            raw[key] = tuple(x for x in items if x != "")  # "--directory ''": none
    if raw.get("shard_home") and raw.get("directory"):
        raise ConfigError("give directory (one group's replicas) or shard_home, not both")
    if raw.get("shard_home"):
        raw["directory"] = ()  # the sharded client finds every group from the home's map
    need = ("node_id", "host", "listen", "engine_socket")
    missing = [k for k in need if not raw.get(k)]
    if "directory" not in raw or (not raw["directory"] and not raw.get("shard_home")):
        missing.insert(2, "directory")
    if missing:
        raise ConfigError(f"missing required keys: {', '.join(missing)}")
    try:
        cfg = AgentConfig(pools=tuple(pools), engines=engines, tls=tls, auth=auth, **raw)
    except TypeError as e:
        raise ConfigError(str(e)) from e
    _check(cfg)
    return cfg


def _engines(raw: Any) -> tuple[EngineConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError("[[engines]] must be a list of tables")
    out = []
    for i, e in enumerate(raw):
        try:
            out.append(EngineConfig(**e))
        except TypeError as err:
            raise ConfigError(f"[[engines]] #{i + 1}: {err}") from err
    return tuple(out)


def _check_engine(i: int, e: EngineConfig) -> None:
    where = f"[[engines]] #{i + 1}"
    if not e.name or not all(c.isalnum() or c in "-_." for c in e.name):
        raise ConfigError(f"{where}: name is required (letters, digits, - _ .)")
    if not e.model or e.block_tokens <= 0:
        raise ConfigError(f"{where}: model and block_tokens > 0 are required")
    if not e.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{where}: endpoint must be tcp://, ipc:// or inproc://")
    if e.replay_endpoint and not e.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{where}: replay_endpoint must be tcp://, ipc:// or inproc://")
    if e.kind not in ENGINE_KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(ENGINE_KINDS)}")
    if e.hash_format not in HASH_FORMATS:
        raise ConfigError(f"{where}: hash_format must be one of {', '.join(HASH_FORMATS)}")
    if e.hash_algo not in HASH_ALGOS:
        raise ConfigError(f"{where}: hash_algo must be one of {', '.join(HASH_ALGOS[1:])}")
    if not 1 <= e.dp_size <= DP_SIZE_MAX or e.dp_rank_start < 0:
        raise ConfigError(f"{where}: dp_size must be in 1..{DP_SIZE_MAX}, dp_rank_start >= 0")
    if e.replay_timeout_ms <= 0:
        raise ConfigError(f"{where}: replay_timeout_ms must be > 0")


def _check(cfg: AgentConfig) -> None:
    if not LEASE_MS_MIN <= cfg.lease_ms <= LEASE_MS_MAX:
        raise ConfigError(f"lease_ms must be in {LEASE_MS_MIN}..{LEASE_MS_MAX}")
    bad = [t for t in cfg.transports if t not in TRANSPORTS]
    if bad or not cfg.transports:
        raise ConfigError(
            f"transports must be a non-empty subset of {', '.join(TRANSPORTS)} (got {bad})"
        )
    if cfg.rdma_gpu and "rdma" not in cfg.transports:
        raise ConfigError("rdma_gpu needs 'rdma' in transports (and is unverified: docs/gpu.md)")
    if cfg.rdma_port < 0 or cfg.rdma_gid_index < -1:
        raise ConfigError("rdma_port must be >= 0 (0: auto), rdma_gid_index >= -1 (-1: auto)")
    seen = set()
    for i, p in enumerate(cfg.pools):
        if not p.model or p.block_tokens <= 0:
            raise ConfigError(f"[[pools]] #{i + 1}: model and block_tokens > 0 are required")
        if p.slot_bytes <= 0 or p.slots <= 0 or p.slot_bytes * p.slots > POOL_BYTES_MAX:
            raise ConfigError(
                f"[[pools]] #{i + 1}: slot_bytes and slots must be > 0 "
                f"and the pool at most {POOL_BYTES_MAX} bytes"
            )
        if p.tier not in ("host", "gpu"):
            raise ConfigError(f"[[pools]] #{i + 1}: tier must be 'host' or 'gpu'")
        if p.tier == "gpu" and ("cuda" not in cfg.transports or p.gpu_device < 0):
            raise ConfigError(
                f"[[pools]] #{i + 1}: tier 'gpu' needs 'cuda' in transports and gpu_device >= 0"
            )
        key = namespace_key(p.namespace())
        if key in seen:
            raise ConfigError(f"[[pools]] #{i + 1}: two pools for one namespace")
        seen.add(key)
    names = [e.name for e in cfg.engines]
    if len(set(names)) != len(names):
        raise ConfigError("[[engines]]: two engines with one name")
    for i, e in enumerate(cfg.engines):
        _check_engine(i, e)
    if cfg.fetch_timeout_ms <= 0 or cfg.publish_batch_window_ms <= 0:
        raise ConfigError("fetch_timeout_ms and publish_batch_window_ms must be > 0")
    _check_mirror(cfg)


def _check_mirror(cfg: AgentConfig) -> None:
    if not isinstance(cfg.directory_mirror, bool):
        raise ConfigError(f"directory_mirror must be true or false, not {cfg.directory_mirror!r}")
    lo, hi = DIRECTORY_MIRROR_STALENESS_MS_MIN, DIRECTORY_MIRROR_STALENESS_MS_MAX
    ms = cfg.directory_mirror_staleness_ms
    if isinstance(ms, bool) or not isinstance(ms, int) or not lo <= ms <= hi:
        raise ConfigError(
            f"directory_mirror_staleness_ms must be an integer in {lo}..{hi} (got {ms!r})"
        )


def load(path: str, overrides: dict[str, Any] | None = None) -> AgentConfig:
    return from_dict(read_toml(path, overrides))
