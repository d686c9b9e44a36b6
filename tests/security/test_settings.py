"""Security settings and invariants that need no running daemon."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvdir.agent.config import from_dict as agent_from_dict
from kvdir.core.config import ConfigError
from kvdir.core.security import ClientSecurity, SecurityConfigError, may_act_for, read_tokens
from kvdir.directory.config import from_dict

ROOT = Path(__file__).resolve().parents[2]
BASE = {"replica_id": "r1", "raft_address": "127.0.0.1:1", "grpc_address": "127.0.0.1:2"}


def _dir(**extra: object) -> dict[str, object]:
    return {**BASE, "data_dir": "/tmp/x", **extra}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tls": {"cert": "c"}}, "needs all of cert, key and ca"),
        ({"auth": {"tokens_file": "t"}}, "tokens_file needs [tls]"),
        ({"auth": {"token_file": "t"}}, "token_file needs [tls]"),
        (
            {"tls": {"cert": "c", "key": "k", "ca": "a", "require_client_cert": False}},
            "nobody can authenticate",
        ),
        ({"tls": {"cert": 5}}, "[tls] cert must be a str"),
        ({"tls": {"bogus": 1}}, "unknown keys: bogus"),
        ({"auth": {"admins": "root"}}, "admins must be an array"),
    ],
)
def test_unusable_security_settings_are_refused_with_a_reason(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_dict(_dir(**extra))


def test_a_full_secure_config_parses() -> None:
    cfg = from_dict(
        _dir(
            tls={"cert": "c", "key": "k", "ca": "a"},
            auth={"admins": ["ops"], "raft_password_file": "p", "tokens_file": "t"},
        )
    )
    assert cfg.tls.enabled and cfg.tls.require_client_cert
    assert cfg.auth.admins == ("ops",)


def test_the_agent_refuses_directory_only_auth_settings() -> None:
    raw = {
        "node_id": "a",
        "host": "h",
        "directory": ["x:1"],
        "listen": "h:1",
        "engine_socket": "/tmp/s",
        "pools": [{"model": "m", "block_tokens": 16, "slot_bytes": 4096, "slots": 4}],
        "auth": {"raft_password_file": "p"},
    }
    with pytest.raises(ConfigError, match="directory settings"):
        agent_from_dict(raw)


def test_client_credentials_need_tls() -> None:
    with pytest.raises(SecurityConfigError, match="needs --ca"):
        ClientSecurity(token="a.b")
    with pytest.raises(SecurityConfigError, match="needs --ca"):
        ClientSecurity(cert="c", key="k")
    with pytest.raises(SecurityConfigError, match="both cert and key"):
        ClientSecurity(ca="a", cert="c")


def test_who_may_act_for_which_node() -> None:
    assert may_act_for(None, "anything", ())  # plain mode
    assert may_act_for("node-a", "node-a", ())
    assert may_act_for("node-a", "node-a/vllm0/dp1", ())
    assert not may_act_for("node-a", "node-ab", ())
    assert not may_act_for("node-a", "node-b", ())
    assert not may_act_for("node-a", "", ())
    assert may_act_for("ops", "node-b", ("ops",))


def test_tokens_files_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "ok.toml"
    good.write_text('node-a = "s1"\n')
    assert read_tokens(str(good)) == {"node-a": "s1"}
    for text in ("node-a = 5\n", 'node-a = ""\n', '"a.b" = "s"\n', "not toml ="):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(SecurityConfigError):
            read_tokens(str(bad))


def _access_names(path: Path) -> set[str]:
    return {
        n.attr
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute) and n.attr.startswith("IBV_ACCESS_")
    }


def test_rdma_memory_is_exposed_for_remote_read_only() -> None:
    """Every access flag the rdma backends register memory or QPs with.

    pyverbs is not installed here (the rdma tier runs in a VM), so this reads
    the flags from the source: no MR or QP may ever grant remote writes,
    atomics or memory-window binds.
    """
    used: set[str] = set()
    for name in ("rdma.py", "rdma_gpu.py"):
        used |= _access_names(ROOT / "transfer" / name)
    assert "IBV_ACCESS_REMOTE_READ" in used
    assert used <= {"IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ"}, used
