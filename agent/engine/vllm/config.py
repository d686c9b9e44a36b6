"""The connector's settings: `kv_connector_extra_config` of vLLM's --kv-transfer-config.

Every key, its default and what it bounds (docs/vllm.md lists them for users)::

    agent_socket        the node agent's kvdir.v1.Engine Unix socket
    model               the namespace's model ("" = vLLM's served model name)
    lookup_timeout_ms   a request's whole lookup (local pool + directory) deadline
    lookup_wait_ms      how long one scheduler call waits for that lookup inline
    load_timeout_ms     one load's fetch deadline (the agent gives up on the peer)
    agent_retry_s       after the agent failed, lookups answer 0 for this long
    min_load_blocks     shorter external hits are recomputed instead of loaded
    save                store computed full blocks into the node's pool
    save_reserve_slots  pool slots kept allocated ahead, so saving never waits (at least
                        twice what one step can complete, at most half the pool)
    skip_slow_pulls     skip a peer pull this engine's own measurements say is slower than
                        recomputing the same tokens (its pool's blocks are always read)
    inline_loads        (CUDA) load what is on this host (this node's pool, a same-host
                        peer over CUDA IPC or shm) on the engine's thread as the step
                        starts and report it done in that step; off (and on CPU): on
                        the worker's load thread, reported by the first step after it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvdir.agent.limits import CHAIN_BLOCKS_MAX

LOOKUP_TIMEOUT_MS_MAX = 10_000
LOAD_TIMEOUT_MS_MAX = 120_000
SAVE_RESERVE_SLOTS_MAX = 65_536


class ConnectorConfigError(ValueError):
    """A kv_connector_extra_config key is unknown or out of range (the message says which)."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    agent_socket: str = "/run/kvdir/agent.sock"
    model: str = ""
    lookup_timeout_ms: int = 300
    lookup_wait_ms: int = 5
    load_timeout_ms: int = 5000
    agent_retry_s: float = 5.0
    min_load_blocks: int = 1
    save: bool = True
    save_reserve_slots: int = 256
    skip_slow_pulls: bool = True
    inline_loads: bool = True


_BOUNDS: dict[str, tuple[float, float]] = {
    "lookup_timeout_ms": (1, LOOKUP_TIMEOUT_MS_MAX),
    "lookup_wait_ms": (0, LOOKUP_TIMEOUT_MS_MAX),
    "load_timeout_ms": (1, LOAD_TIMEOUT_MS_MAX),
    "agent_retry_s": (0, 3600),
    "min_load_blocks": (1, CHAIN_BLOCKS_MAX),
    "save_reserve_slots": (1, SAVE_RESERVE_SLOTS_MAX),
}


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ConnectorConfig)}


def _checked(name: str, value: Any) -> Any:
    kind = type(_DEFAULTS[name])
    if kind is bool:
        if not isinstance(value, bool):
            raise ConnectorConfigError(f"kvdir connector: {name} must be true or false")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ConnectorConfigError(f"kvdir connector: {name} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConnectorConfigError(f"kvdir connector: {name} must be a number")
    if kind is int and value != int(value):
        raise ConnectorConfigError(f"kvdir connector: {name} must be an integer")
    lo, hi = _BOUNDS[name]
    if not lo <= value <= hi:
        raise ConnectorConfigError(f"kvdir connector: {name} must be in {lo}..{hi}")
    return kind(value)


def from_extra(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Parse kv_connector_extra_config (unknown keys and bad values are errors)."""
    raw = dict(extra or {})
    fields = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConnectorConfigError(
            f"kvdir connector: unknown kv_connector_extra_config keys: {', '.join(unknown)} "
            f"(known: {', '.join(fields)})"
        )
    out = {name: _checked(name, value) for name, value in raw.items()}
    cfg = ConnectorConfig(**out)
    if not cfg.agent_socket:
        raise ConnectorConfigError("kvdir connector: agent_socket is required")
    return cfg
