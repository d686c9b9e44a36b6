"""The sharded client's pure parts, and the configs that select it (no network here;
tests/integration/test_sharded.py runs it against real groups)."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.agent.config import from_dict
from kvdir.core.client import DirectoryError, OutcomeUnknown, Unavailable
from kvdir.core.config import ConfigError
from kvdir.core.shard_map import Group, even_map
from kvdir.core.shard_route import Router
from kvdir.core.sharded_client import chain_hashes, worst
from kvdir.v1 import directory_pb2 as pb

FAIL = grpc.StatusCode.FAILED_PRECONDITION
DOWN = grpc.StatusCode.UNAVAILABLE


def test_worst_part_error_is_what_the_call_raises() -> None:
    unknown = OutcomeUnknown(grpc.StatusCode.DEADLINE_EXCEEDED, "maybe")
    refused = DirectoryError(FAIL, "no such node", "unknown-node")
    plain = DirectoryError(grpc.StatusCode.INTERNAL, "boom")
    down = Unavailable(DOWN, "down")
    assert worst([down, refused, unknown]) is unknown  # any unknown part: the call's is
    assert worst([down, plain, refused]) is refused  # a reason the agent acts on
    assert worst([down, plain]) is plain
    assert worst([down]) is down
    bug = ValueError("closed")
    assert worst([unknown, bug]) is bug  # not a directory error: a bug, never hidden


def test_chain_hashes_reads_every_wire_form() -> None:
    hs = [bytes([i]) * 8 for i in range(5)]
    packed = pb.LookupRequest(packed_hashes=b"".join(hs), hash_width=8)
    listed = pb.LookupRequest(block_hashes=hs)
    ids = pb.LookupRequest(block_ids=[struct.unpack(">Q", h)[0] for h in hs])
    assert chain_hashes(packed) == chain_hashes(listed) == chain_hashes(ids) == hs
    assert chain_hashes(pb.LookupRequest(packed_hashes=b"abc", hash_width=2)) == []


def test_router_agrees_with_the_map() -> None:
    m = even_map([Group(f"g{i}", (f"127.0.0.1:{i + 1}",)) for i in range(3)], 2)
    r = Router(m, routes_max=50)
    hs = [i.to_bytes(8, "big") for i in range(120)]
    for _ in range(2):  # cold, then partly remembered (the memo is cleared when full)
        got = {g: p.tolist() for g, p in r.positions(hs).items()}
        assert got == m.positions_by_group(hs)
        assert list(got) == list(m.positions_by_group(hs))  # groups in first-block order


BASE = {
    "node_id": "n",
    "host": "127.0.0.1",
    "listen": "127.0.0.1:1",
    "engine_socket": "/tmp/x.sock",
    "pools": [{"model": "m", "block_tokens": 16, "slot_bytes": 4096, "slots": 8}],
}


def test_agent_config_shard_home_instead_of_directory() -> None:
    cfg = from_dict({**BASE, "shard_home": "127.0.0.1:7101,127.0.0.1:7102"})
    assert cfg.shard_home == ("127.0.0.1:7101", "127.0.0.1:7102") and cfg.directory == ()
    cfg = from_dict({**BASE, "directory": ["127.0.0.1:7101"]})
    assert cfg.shard_home == () and cfg.directory == ("127.0.0.1:7101",)
    with pytest.raises(ConfigError, match="not both"):
        from_dict({**BASE, "directory": ["a:1"], "shard_home": ["b:1"]})
    with pytest.raises(ConfigError, match="directory"):
        from_dict(dict(BASE))
    cfg = from_dict({**BASE, "directory": "", "shard_home": ["b:1"]})  # --directory ''
    assert cfg.shard_home == ("b:1",)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=200),
    st.integers(1, 40),
    st.sampled_from([1, 2, 5]),
)
def test_the_packed_router_agrees_with_the_map(
    keys: list[int], routes_max: int, groups: int
) -> None:
    """Small integers (not uniform), repeats inside a chain, a memo small enough to
    probe past collisions, grow and be cleared: always the map's answer."""
    m = even_map([Group(f"g{i}", (f"127.0.0.1:{i + 1}",)) for i in range(groups)], 2)
    r = Router(m, routes_max=routes_max)
    hs = [k.to_bytes(8, "little") for k in keys]
    for part in (hs, hs[: len(hs) // 2], hs):  # cold, partly remembered, after clears
        got = r.positions_packed(b"".join(part), 8)
        assert {g: p.tolist() for g, p in got.items()} == m.positions_by_group(part)
        assert list(got) == list(m.positions_by_group(part))
        if len(set(part)) <= routes_max:  # what was just routed is remembered, probed or not
            assert (r._memo64.get(np.frombuffer(b"".join(part), np.uint64)) >= 0).all()
