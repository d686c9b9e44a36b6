"""Configuration helpers every daemon shares: TOML files, sections, [tls] and [auth].

Each daemon (directory, agent, gateway) owns its own config dataclass; what they
have in common is how a file is read, how a section becomes a dataclass (unknown
keys refused by name), and the security sections, so the three refuse bad input
with the same words.
"""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

from kvdir.core.security import AuthConfig, SecurityConfigError, TlsConfig
from kvdir.core.security import check as check_security


class ConfigError(ValueError):
    """The configuration is unusable; the message says which field and why."""


def section(cls: Any, raw: Any, section: str) -> Any:
    """`raw` (a TOML table or None) as a `cls` dataclass; unknown keys are refused."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"[{section}] must be a table")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"[{section}] has unknown keys: {', '.join(unknown)}")
    return cls(**raw)


def read_toml(path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TOML config file as a dict, with the non-None `overrides` (flags) on top."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return raw


def security_sections(raw: dict[str, Any]) -> tuple[TlsConfig, AuthConfig]:
    """Pop and check the [tls] and [auth] sections of a config dict."""
    tls = section(TlsConfig, raw.pop("tls", None), "tls")
    auth_raw = raw.pop("auth", None)
    if isinstance(auth_raw, dict) and "admins" in auth_raw:
        admins = auth_raw["admins"]
        if not isinstance(admins, list) or not all(isinstance(a, str) for a in admins):
            raise ConfigError("[auth] admins must be an array of identities")
        auth_raw = {**auth_raw, "admins": tuple(admins)}
    auth = section(AuthConfig, auth_raw, "auth")
    for name, obj in (("tls", tls), ("auth", auth)):
        for f in dataclasses.fields(obj):
            value, want = getattr(obj, f.name), type(getattr(type(obj)(), f.name))
            if not isinstance(value, want):
                raise ConfigError(f"[{name}] {f.name} must be a {want.__name__}")
    try:
        check_security(tls, auth)
    except SecurityConfigError as e:
        raise ConfigError(str(e)) from e
    return tls, auth
