"""A replica's shard settings (directory/config.py) and its initial map file
(`DirectoryDaemon._init_map`): bad input is one readable error, never a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvdir.core.config import ConfigError
from kvdir.core.shard_map import Group, even_map
from kvdir.directory.config import from_dict
from kvdir.directory.daemon import DirectoryDaemon, StartError

BASE = {
    "replica_id": "r1",
    "raft_address": "127.0.0.1:7001",
    "grpc_address": "127.0.0.1:7101",
    "data_dir": "/nonexistent",
}


def cfg(**over: Any) -> Any:
    return from_dict({**BASE, **over})


def test_unsharded_by_default() -> None:
    c = cfg()
    assert c.group == "g0" and not c.sharded and c.shard_home == ()


def test_sharded_settings() -> None:
    c = cfg(group="g1", shard_home=["127.0.0.1:1", "127.0.0.1:2"], shard_refresh_ms=250)
    assert c.sharded and c.shard_home == ("127.0.0.1:1", "127.0.0.1:2")
    assert cfg(shard_map_init="/x.json").sharded  # the home group needs no --shard-home


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"group": "g/1"}, "group must be 1-64 of"),
        ({"group": ""}, "group must be 1-64 of"),
        ({"group": "g1", "shard_map_init": "/x.json"}, "for the home group 'g0'"),
        ({"shard_refresh_ms": 0}, "shard_refresh_ms must be > 0"),
        ({"shard_home": "127.0.0.1:1"}, "shard_home must be an array"),
        ({"shard_home": ["a:1,b:2"]}, "shard_home is a list of HOST:PORT"),
    ],
)
def test_bad_settings_are_one_clear_error(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg(**over)


def init_map_of(tmp_path: Path, text: str | bytes) -> object:
    path = tmp_path / "map.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return DirectoryDaemon(cfg(shard_map_init=str(path)))._init_map()


def test_the_initial_map_file(tmp_path: Path) -> None:
    m = even_map([Group("g0", ("127.0.0.1:1",)), Group("g1", ("127.0.0.1:2",))])
    assert init_map_of(tmp_path, m.to_json()) == m
    with pytest.raises(StartError, match="the first map is version 1, not 2"):
        init_map_of(tmp_path, m.with_split(0, 5).to_json())
    with pytest.raises(StartError, match="not a shard map"):
        init_map_of(tmp_path, "{")
    with pytest.raises(StartError, match=r"map\.json: .*utf-8"):
        init_map_of(tmp_path, b"\xff\xfe")
    with pytest.raises(StartError, match="No such file"):
        DirectoryDaemon(cfg(shard_map_init=str(tmp_path / "absent.json")))._init_map()
