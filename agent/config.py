"""Configuration of a node agent: a TOML file (deploy/config/agent.toml), or flags.

node_id = "node-a"
host = "10.0.1.7"                       # the address peers reach this node on
directory = ["10.0.0.1:7101", "10.0.0.2:7101", "10.0.0.3:7101"]
listen = "10.0.1.7:7301"                # kvdir.v1.Agent for peers
engine_socket = "/run/kvdir/agent.sock" # kvdir.v1.Engine for the local engine
metrics_address = "10.0.1.7:7302"
transports = ["shm", "tcp"]
lease_ms = 10000
pool_dir = "/dev/shm"

[[pools]]                               # one per namespace the engine serves
model = "meta-llama/Llama-3.1-8B"
dtype = "bf16"
block_tokens = 16
layout = "vllm-paged"
slot_bytes = 2097152                    # KV bytes of one block
slots = 4096
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from directory.config import ConfigError
from directory.limits import LEASE_MS_DEFAULT, LEASE_MS_MAX, LEASE_MS_MIN
from proto.kvdir.v1 import directory_pb2 as pb

POOL_BYTES_MAX = 1 << 40


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
    metrics_address: str = ""
    transports: tuple[str, ...] = ("shm", "tcp")
    lease_ms: int = LEASE_MS_DEFAULT
    pool_dir: str = "/dev/shm"
    fetch_timeout_ms: int = 5000
    log_format: str = "json"
    publish_batch_window_ms: int = 5
    publish_pending_max: int = 65536
    resync_interval_s: float = 300.0

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
    names = {f.name for f in dataclasses.fields(AgentConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown keys: {', '.join(unknown)}")
    for key in ("directory", "transports"):
        if key in raw:
            value = raw[key]
            raw[key] = tuple(value.split(",") if isinstance(value, str) else value)
    missing = [
        k for k in ("node_id", "host", "directory", "listen", "engine_socket") if not raw.get(k)
    ]
    if missing:
        raise ConfigError(f"missing required keys: {', '.join(missing)}")
    try:
        cfg = AgentConfig(pools=tuple(pools), **raw)
    except TypeError as e:
        raise ConfigError(str(e)) from e
    _check(cfg)
    return cfg


def _check(cfg: AgentConfig) -> None:
    if not LEASE_MS_MIN <= cfg.lease_ms <= LEASE_MS_MAX:
        raise ConfigError(f"lease_ms must be in {LEASE_MS_MIN}..{LEASE_MS_MAX}")
    bad = [t for t in cfg.transports if t not in ("tcp", "shm")]
    if bad or not cfg.transports:
        raise ConfigError(f"transports must be a non-empty subset of tcp, shm (got {bad})")
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
        key = p.namespace().SerializeToString(deterministic=True)
        if key in seen:
            raise ConfigError(f"[[pools]] #{i + 1}: two pools for one namespace")
        seen.add(key)
    if cfg.fetch_timeout_ms <= 0 or cfg.publish_batch_window_ms <= 0:
        raise ConfigError("fetch_timeout_ms and publish_batch_window_ms must be > 0")


def load(path: str, overrides: dict[str, Any] | None = None) -> AgentConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(raw)
