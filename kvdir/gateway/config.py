"""Gateway configuration: a TOML file (flags override its top-level keys).

Example (docs/gateway.md has the whole list)::

    listen = "0.0.0.0:8080"
    directory = ["10.0.0.1:7101", "10.0.0.2:7101", "10.0.0.3:7101"]
    policy = "affinity+pool"

    [[models]]
    name = "meta-llama/Llama-3.1-8B-Instruct"   # the request's "model"
    tokenizer = "/models/llama/tokenizer.json"
    chat_template = "/models/llama/chat_template.jinja"
    block_tokens = 16
    hash = "vllm"                                # vllm | sglang | kvdir
    hash_algo = "sha256"

    [[backends]]
    url = "http://10.0.0.5:8000"
    node_id = "node5/vllm0/dp0"                  # the holder id its agent publishes under
    host = "10.0.0.5"
    transports = ["rdma", "tcp"]
    max_concurrency = 64
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvdir.core.config import ConfigError, read_toml
from kvdir.core.hashing import VLLM_ALGOS
from kvdir.core.security import ClientSecurity, SecurityConfigError, read_secret
from kvdir.routing import SHAPES, Policy

HASH_SCHEMES = ("vllm", "sglang", "kvdir")
WORKERS_MAX = 64
"""Most gateway worker processes on one port (each holds a whole mirror of the directory)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One served model: how its prompts become the directory's block keys."""

    name: str
    tokenizer: str = ""
    """Path of a Hugging Face `tokenizers` JSON file (empty: token-id prompts only)."""
    chat_template: str = ""
    """Path of a Jinja chat template (empty: chat requests are routed without a prefix)."""
    add_special_tokens: bool = True
    """For text prompts of /v1/completions (vLLM's default); chat prompts use the template's."""
    bos_token: str = ""
    eos_token: str = ""
    namespace_model: str = ""
    """The directory namespace's model (empty: `name`)."""
    block_tokens: int = 16
    dtype: str = ""
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 0
    hash: str = "vllm"
    hash_algo: str = "sha256"
    hash_seed: str = ""
    hash_bytes: bool = False
    """vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: keys are the whole digests."""
    shape: str = "llama-3-8b"
    """The cost model's shape (kvdir.routing.SHAPES)."""
    max_prompt_tokens: int = 1 << 20


@dataclass(frozen=True, slots=True)
class BackendConfig:
    url: str
    node_id: str
    host: str = ""
    transports: tuple[str, ...] = ()
    max_concurrency: int = 64
    models: tuple[str, ...] = ()
    """Models this backend serves (empty: all)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    backends: tuple[BackendConfig, ...]
    models: tuple[ModelConfig, ...] = ()
    listen: str = "127.0.0.1:8080"
    directory: tuple[str, ...] = ()
    """Directory replicas' gRPC addresses (empty: no lookups, every decision is degraded)."""
    shard_home: tuple[str, ...] = ()
    """A sharded directory's home group (g0), instead of `directory`: lookups follow
    the shard map it holds (one mirror stream per group; docs/sharding.md)."""
    policy: str = Policy.AFFINITY_POOL.value
    tls_cert: str = ""
    tls_key: str = ""
    backend_ca_file: str = ""
    """CA bundle for https:// backends (empty: the system's)."""
    directory_ca: str = ""
    """The directory's CA: talk TLS to it (docs/security.md); empty: plain gRPC."""
    directory_cert: str = ""
    """Client certificate toward the directory (mutual TLS); lookups need any identity."""
    directory_key: str = ""
    directory_token_file: str = ""
    """Bearer token file (`<identity>.<secret>`) toward the directory, instead of a cert."""
    directory_server_name: str = ""
    """Name to expect in the directory's certificates (IP-only addresses)."""
    lookup_timeout_ms: int = 100
    """Deadline of one directory lookup; past it the request is routed least-loaded."""
    directory_retry_s: float = 1.0
    """After a failed lookup, route least-loaded for this long before asking again."""
    lookup_batch_max: int = 256
    directory_mirror: bool = True
    """Answer lookups from an in-process mirror of the directory (a Watch stream);
    the RPC path serves while the mirror is stale (kvdir/gateway/mirror_source.py)."""
    directory_mirror_staleness_ms: int = 1000
    """Past this lag behind the leader (or silence) the mirror is stale."""
    health_path: str = "/health"
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 600.0
    """Longest wait for a backend's response headers (prefill of a long prompt included)."""
    retries: int = 2
    """Other backends tried when one fails before sending a byte."""
    queue_timeout_s: float = 30.0
    """Longest wait for a free slot when every backend is at max_concurrency."""
    body_max_bytes: int = 64 * 1024 * 1024
    balance_abs: float = 32.0
    balance_rel: float = 1.5
    seed: int = 0
    log_format: str = "json"
    passthrough: bool = False
    """No parsing or routing: round-robin over healthy backends (the benchmark's baseline)."""
    workers: int = 1
    """Gateway processes sharing `listen` with SO_REUSEPORT (kvdir/gateway/workers.py)."""
    worker_port_base: int = 0
    """Worker i also serves on `listen`'s host at this port + i, so each worker's own
    /metrics can be scraped (0: no per-worker ports)."""
    engine_metrics: bool = True
    """Poll each backend's Prometheus metrics for its own load (kvdir/gateway/engine_load.py)."""
    engine_metrics_path: str = "/metrics"
    engine_metrics_interval_s: float = 1.0
    engine_metrics_timeout_s: float = 0.5

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


def _table(cls: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where} has unknown keys: {', '.join(unknown)}")
    vals = dict(raw)
    for f in dataclasses.fields(cls):
        if f.name in vals and isinstance(vals[f.name], list):
            vals[f.name] = tuple(vals[f.name])
    try:
        return cls(**vals)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def _addresses(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        return tuple(a.strip() for a in v.split(",") if a.strip())
    if isinstance(v, list | tuple) and all(isinstance(a, str) for a in v):
        return tuple(v)
    raise ConfigError("directory must be a list of HOST:PORT strings (or one comma-separated)")


def host_port(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} {addr!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _check_model(m: ModelConfig) -> None:
    where = f"[[models]] {m.name!r}"
    if not m.name:
        raise ConfigError('[[models]] needs a name (the requests\' "model")')
    if m.block_tokens <= 0 or m.max_prompt_tokens <= 0:
        raise ConfigError(f"{where}: block_tokens and max_prompt_tokens must be > 0")
    if m.hash not in HASH_SCHEMES:
        raise ConfigError(f"{where}: hash must be one of {', '.join(HASH_SCHEMES)}")
    if m.hash == "vllm" and m.hash_algo not in VLLM_ALGOS:
        raise ConfigError(f"{where}: hash_algo must be one of {', '.join(VLLM_ALGOS)}")
    if m.shape not in SHAPES:
        raise ConfigError(f"{where}: shape must be one of {', '.join(SHAPES)}")


def _check_backend(b: BackendConfig) -> None:
    u = urlsplit(b.url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"[[backends]] url {b.url!r} must be http(s)://HOST[:PORT]")
    if u.path not in ("", "/") or u.query:
        raise ConfigError(f"[[backends]] url {b.url!r}: no path (the request's path is kept)")
    if not b.node_id:
        raise ConfigError(f"[[backends]] {b.url}: node_id is required (the directory holder id)")
    if b.max_concurrency <= 0:
        raise ConfigError(f"[[backends]] {b.url}: max_concurrency must be > 0")


def from_dict(raw: dict[str, Any]) -> GatewayConfig:
    raw = dict(raw)
    backends_raw = raw.pop("backends", [])
    models_raw = raw.pop("models", [])
    if not isinstance(backends_raw, list) or not isinstance(models_raw, list):
        raise ConfigError("backends and models must be arrays of tables ([[backends]], [[models]])")
    backends = tuple(_table(BackendConfig, b, "[[backends]]") for b in backends_raw)
    models = tuple(_table(ModelConfig, m, "[[models]]") for m in models_raw)
    for key in ("directory", "shard_home"):
        if key in raw:
            raw[key] = _addresses(raw[key])
    if raw.get("directory") and raw.get("shard_home"):
        raise ConfigError("give directory (one group's replicas) or shard_home, not both")
    cfg: GatewayConfig = _table(
        GatewayConfig, {**raw, "backends": backends, "models": models}, "the gateway config"
    )
    check(cfg)
    return cfg


def directory_security(cfg: GatewayConfig) -> ClientSecurity:
    """How the gateway reaches the directory (the directory_* keys)."""
    token = ""
    if cfg.directory_token_file:
        token = read_secret(cfg.directory_token_file, "directory_token_file")
    return ClientSecurity(
        cfg.directory_ca,
        cfg.directory_cert,
        cfg.directory_key,
        token,
        cfg.directory_server_name,
    )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object, name: str) -> float:
    """`v` as a number, or a ConfigError naming the key (TOML gives strings and booleans
    as they are; comparing them with numbers would be a TypeError, not a reason)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{name} must be a number, not {v!r}")
    return float(v)


def _check_workers(cfg: GatewayConfig) -> None:
    n = cfg.workers
    if not _is_int(n) or not 1 <= n <= WORKERS_MAX:
        raise ConfigError(
            f"workers must be an integer from 1 to {WORKERS_MAX} "
            f"(gateway processes sharing the listen port), not {n!r}"
        )
    if n > 1 and host_port(cfg.listen, "listen")[1] == 0:
        raise ConfigError("workers > 1 needs a fixed listen port (port 0 gives each its own)")
    base = cfg.worker_port_base
    if not _is_int(base) or (base != 0 and not 1 <= base <= 65536 - n):
        raise ConfigError(
            f"worker_port_base must be 0 (none) or a port with room for {n} workers, not {base!r}"
        )


def check(cfg: GatewayConfig) -> None:
    """Refuse what cannot work, with a reason naming the key."""
    if not cfg.backends:
        raise ConfigError("at least one [[backends]] entry is required")
    for b in cfg.backends:
        _check_backend(b)
    ids = [b.node_id for b in cfg.backends]
    if len(set(ids)) != len(ids):
        raise ConfigError("[[backends]] node_id values must be unique")
    for m in cfg.models:
        _check_model(m)
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError("[[models]] names must be unique")
    try:
        Policy(cfg.policy)
    except ValueError:
        raise ConfigError(
            f"policy {cfg.policy!r} must be one of {', '.join(p.value for p in Policy)}"
        ) from None
    host_port(cfg.listen, "listen")
    for a in (*cfg.directory, *cfg.shard_home):
        host_port(a, "directory address")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key go together")
    try:
        directory_security(cfg)
    except SecurityConfigError as e:
        raise ConfigError(f"directory_*: {e}") from None
    positive = (
        "lookup_timeout_ms",
        "directory_retry_s",
        "lookup_batch_max",
        "directory_mirror_staleness_ms",
        "health_interval_s",
        "health_timeout_s",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "queue_timeout_s",
        "body_max_bytes",
        "engine_metrics_interval_s",
        "engine_metrics_timeout_s",
    )
    for name in positive:
        if _number(getattr(cfg, name), name) <= 0:
            raise ConfigError(f"{name} must be > 0")
    _check_workers(cfg)
    for name in ("retries", "balance_abs", "balance_rel"):
        _number(getattr(cfg, name), name)
    if cfg.retries < 0 or cfg.balance_abs < 0 or cfg.balance_rel < 1:
        raise ConfigError("retries and balance_abs must be >= 0, balance_rel >= 1")
    if not cfg.health_path.startswith("/") or not cfg.engine_metrics_path.startswith("/"):
        raise ConfigError("health_path and engine_metrics_path must start with /")
    if cfg.log_format not in ("json", "text"):
        raise ConfigError("log_format must be 'json' or 'text'")


def load(path: str, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    return from_dict(read_toml(path, overrides))


__all__ = [
    "HASH_SCHEMES",
    "WORKERS_MAX",
    "BackendConfig",
    "ConfigError",
    "GatewayConfig",
    "ModelConfig",
    "check",
    "field",
    "from_dict",
    "host_port",
    "load",
]
