"""The security flags of `kvdir` commands (docs/security.md), kept out of cli.py.

Daemons take ``--tls-*`` / ``--tokens-file`` / ... flags that land in their
``[tls]`` and ``[auth]`` config sections (over a --config file's values);
`kvdir ctl` takes ``--ca --cert --key --token-file`` (or ``KVDIR_TOKEN``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvdir.core.security import ClientSecurity, read_secret

TOKEN_ENV = "KVDIR_TOKEN"

_DAEMON_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    # flag, section, key, help
    ("--tls-cert", "tls", "cert", "PEM certificate this daemon serves (and dials) with"),
    ("--tls-key", "tls", "key", "PEM private key of --tls-cert"),
    ("--tls-ca", "tls", "ca", "PEM CA that signs every kvdir certificate"),
    ("--tokens-file", "auth", "tokens_file", 'TOML of accepted bearer tokens: id = "secret"'),
)
_DIRECTORY_FLAGS = (
    ("--raft-password-file", "auth", "raft_password_file", "secret that encrypts Raft traffic"),
)
_AGENT_FLAGS = (
    ("--token-file", "auth", "token_file", "this agent's own bearer token <node>.<secret>"),
)


def _dest(flag: str) -> str:
    return "sec_" + flag.lstrip("-").replace("-", "_")


def add_daemon_flags(p: argparse.ArgumentParser, directory: bool) -> None:
    extra = _DIRECTORY_FLAGS if directory else _AGENT_FLAGS
    for flag, _, _, helptext in (*_DAEMON_FLAGS, *extra):
        p.add_argument(flag, dest=_dest(flag), help=helptext)
    if directory:
        p.add_argument(
            "--admin",
            dest="sec_admin",
            action="append",
            default=[],
            help="an identity that may write for any node (repeat)",
        )
        p.add_argument("--raft-bind", dest="sec_raft_bind", help="Raft listen HOST:PORT")


def apply_daemon_flags(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`raw` (a config dict) with the security flags given merged into its sections."""
    out = dict(raw)
    for flag, section, key, _ in (*_DAEMON_FLAGS, *_DIRECTORY_FLAGS, *_AGENT_FLAGS):
        value = getattr(args, _dest(flag), None)
        if value is not None:
            out[section] = {**(out.get(section) or {}), key: value}
    admins = getattr(args, "sec_admin", None)
    if admins:
        out["auth"] = {**(out.get("auth") or {}), "admins": list(admins)}
    bind = getattr(args, "sec_raft_bind", None)
    if bind:
        out["raft_bind_address"] = bind
    return out


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", default="", help="PEM CA of the cluster: talk TLS")
    p.add_argument("--cert", default="", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key", default="", help="PEM key of --cert")
    p.add_argument(
        "--token-file", default="", help=f"bearer token file (or ${TOKEN_ENV}; needs --ca)"
    )
    p.add_argument("--token", default="", help="bearer token (visible to ps: prefer --token-file)")
    p.add_argument("--server-name", default="", help="name to expect in server certificates")


def client_security(args: argparse.Namespace) -> ClientSecurity:
    token = args.token or os.environ.get(TOKEN_ENV, "")
    if args.token_file:
        token = read_secret(args.token_file, "token file")
    return ClientSecurity(args.ca, args.cert, args.key, token, args.server_name)
