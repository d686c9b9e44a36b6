"""Fixtures of the security tier: a PKI made at test time and a TLS directory.

The directory cluster is three real replica processes serving gRPC over
mutual TLS (any certificate of the test CA, CN = identity), also accepting
bearer tokens, with an encrypted Raft (password file) bound to 127.0.0.1.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdir.local import LocalCluster
from tests.integration.helpers import wait_all_serving
from tests.security.certs import Authority, Leaf

IDENTITIES = ("kvdir-directory", "admin", "node-a", "node-b", "node-c")


@dataclass(frozen=True)
class Pki:
    dir: str
    leaves: dict[str, Leaf]
    rogue: dict[str, Leaf]
    """Same identities, signed by a CA nobody trusts (they trust the real CA)."""
    tokens: dict[str, str]
    """identity -> full bearer token "<identity>.<secret>"."""
    tokens_file: str
    raft_password_file: str


def _secret_file(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def make_pki(base: str) -> Pki:
    ca, rogue = Authority(base, "cluster"), Authority(base, "rogue")
    leaves = {i: ca.issue(i) for i in IDENTITIES}
    rogues = {i: rogue.issue(i, trust=ca.ca_path) for i in ("admin", "node-a")}
    secrets_ = {i: secrets.token_urlsafe(24) for i in IDENTITIES}
    tokens_file = _secret_file(
        os.path.join(base, "tokens.toml"), "".join(f'{i} = "{s}"\n' for i, s in secrets_.items())
    )
    password = _secret_file(os.path.join(base, "raft.password"), secrets.token_urlsafe(24) + "\n")
    return Pki(
        base,
        leaves,
        rogues,
        {i: f"{i}.{s}" for i, s in secrets_.items()},
        tokens_file,
        password,
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def directory_flags(pki: Pki, password_file: str | None = None) -> list[str]:
    return [
        *pki.leaves["kvdir-directory"].daemon_flags(),
        "--tokens-file",
        pki.tokens_file,
        "--admin",
        "admin",
        "--raft-password-file",
        password_file or pki.raft_password_file,
    ]


def start_secure(base: Path, pki: Pki) -> LocalCluster:
    c = LocalCluster(
        str(base), size=3, extra_args=directory_flags(pki), security=pki.leaves["admin"].client()
    )
    try:
        c.start(timeout_s=60)
        wait_all_serving(c, 30)
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture(scope="session")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[LocalCluster]:
    c = start_secure(tmp_path_factory.mktemp("secure-directory"), pki)
    try:
        yield c
    finally:
        c.stop()
