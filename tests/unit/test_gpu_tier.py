"""The GPU tier's CPU-side logic: holder choice, tier records, header validation.

No GPU needed: records of a GPU pool are plain numbers, and the headers that
validate GPU blocks live in host memory (read here through the real shm
transport, as a same-host reader does).
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
from collections.abc import Iterator

import pytest

from kvdir.agent import holders
from kvdir.agent.config import AgentConfig, from_dict
from kvdir.agent.fetcher import _headers, _sources
from kvdir.agent.gpu_pool import PIECE_BYTES_MAX, GpuTier, slot_of, slot_pieces, slot_runs
from kvdir.agent.pool import KvPool, valid_prefix
from kvdir.agent.service import PoolState
from kvdir.core.client import namespace
from kvdir.core.config import ConfigError
from kvdir.transfer.base import Region
from kvdir.transfer.engine import Descriptor, TransferEngine
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb

GPU_BASE = 0x7F00_0000_0000
SLOT = 8192
SLOTS = 64


def _match(
    node: str,
    n: int,
    tier: int,
    host: str = "127.0.0.1",
    transports: tuple[str, ...] = ("tcp", "shm", "cuda"),
    tiers: list[int] | None = None,
) -> holders.Holder:
    addresses = b"".join(struct.pack("<Q", GPU_BASE + i * SLOT) for i in range(n))
    return holders.Holder.of(
        pb.NodeMatch(
            node_id=node,
            prefix_blocks=n,
            host=host,
            agent_endpoint=f"{host}:1",
            transports=list(transports),
            addresses=addresses,
            lengths=struct.pack(f"<{n}I", *[SLOT] * n),
            rkeys=struct.pack(f"<{n}I", *[7] * n),
            generations=struct.pack(f"<{n}Q", *range(1, n + 1)),
            tiers=bytes(tiers if tiers is not None else [tier] * n),
        )
    )


GPU_READER = holders.Reader("127.0.0.1", gpu_pool=True, cuda=True)


def _rank(
    matches: list[holders.Holder], reader: holders.Reader = GPU_READER
) -> list[tuple[str, str]]:
    got = holders.rank(matches, reader, [True] * len(matches), random.Random(1))
    return [(c.match.node_id, c.path) for c in got]


def test_same_host_gpu_is_preferred_over_host_copies_at_equal_prefix() -> None:
    remote = _match("far", 8, pb.TIER_HOST, host="10.0.0.9")
    near = _match("near", 8, pb.TIER_GPU)
    assert _rank([remote, near]) == [("near", holders.CUDA), ("far", holders.HOST)]


def test_a_longer_prefix_beats_a_cheaper_path() -> None:
    assert _rank([_match("near", 4, pb.TIER_GPU), _match("far", 9, pb.TIER_HOST, host="h")]) == [
        ("far", holders.HOST),
        ("near", holders.CUDA),
    ]


def test_gpu_records_go_through_host_copies_without_cuda_or_a_gpu_pool() -> None:
    m = _match("near", 8, pb.TIER_GPU)
    host_reader = holders.Reader("127.0.0.1", gpu_pool=False, cuda=True)
    assert _rank([m], host_reader) == [("near", holders.HOST)]
    no_cuda = _match("near", 8, pb.TIER_GPU, transports=("tcp", "shm"))
    assert _rank([no_cuda]) == [("near", holders.HOST)]


def test_remote_gpu_needs_the_unverified_flag() -> None:
    m = _match("far", 8, pb.TIER_GPU, host="10.0.0.9", transports=("rdma", "rdma-gpu"))
    assert _rank([m]) == [("far", holders.HOST)]
    flagged = holders.Reader("127.0.0.1", gpu_pool=True, cuda=True, rdma_gpu=True)
    assert _rank([m], flagged) == [("far", holders.RDMA_GPU)]


def test_prefix_of_one_tier_and_nothing_usable_means_recompute() -> None:
    mixed = _match("m", 6, pb.TIER_GPU, tiers=[1, 1, 1, 2, 2, 2])
    (c,) = holders.rank([mixed], GPU_READER, [True], random.Random(0))
    assert c.blocks == 3
    sick = _match("s", 8, pb.TIER_GPU)
    assert holders.rank([sick], GPU_READER, [False], random.Random(0)) == []
    assert holders.rank([], GPU_READER, [], random.Random(0)) == []


def test_slot_of_maps_published_gpu_addresses_back_to_slots() -> None:
    assert slot_of(GPU_BASE, SLOT, SLOTS, GPU_BASE + 5 * SLOT) == 5
    for bad in (GPU_BASE - SLOT, GPU_BASE + 3, GPU_BASE + SLOTS * SLOT):
        assert slot_of(GPU_BASE, SLOT, SLOTS, bad) == -1


@pytest.mark.parametrize(
    "slot_bytes", [2 << 20, 1 << 20, 655_360, 393_216, 65_536, 65_552, 4_112, 100, 48, 16 * 4_099]
)
def test_a_slot_copy_is_cut_into_equal_word_pieces_of_at_most_64k(slot_bytes: int) -> None:
    pieces, size = slot_pieces(slot_bytes)
    assert pieces * size == slot_bytes
    if pieces > 1:  # the kernel's 16-byte loads, one thread block a piece
        assert size % 16 == 0 and size <= PIECE_BYTES_MAX
    # The fewest such pieces: no smaller count of whole 16-byte pieces fits.
    for fewer in range(2, pieces):
        size_f, rest = divmod(slot_bytes, fewer)
        assert rest or size_f % 16 or size_f > PIECE_BYTES_MAX
    assert slot_pieces(2 << 20) == (32, 64 << 10)


def test_slots_go_as_runs_of_consecutive_numbers_each_once() -> None:
    assert slot_runs([], 8) == []
    assert slot_runs([5, 3, 4, 0, 7, 4], 8) == [(0, 1), (3, 6), (7, 8)]
    runs = slot_runs(list(range(100, 612)), 1024)  # a reserve handed out in order
    assert runs == [(100, 612)]
    rng = random.Random(7)
    picked = rng.sample(range(4096), 700)
    covered = [s for a, b in slot_runs(picked, 4096) for s in range(a, b)]
    assert covered == sorted(picked)
    for bad in ([-1], [8], [2, 9]):
        with pytest.raises(ValueError, match="outside"):
            slot_runs(bad, 8)


@pytest.fixture
def pool(tmp_path: os.PathLike[str]) -> Iterator[KvPool]:
    p = KvPool.open(os.path.join(tmp_path, "pool"), "ns", SLOT, SLOTS)
    yield p
    p.close()


def _tier(pool: KvPool) -> GpuTier:
    """A GPU tier's addressing (no device memory behind it: nothing reads it here)."""
    return GpuTier(0, GPU_BASE, SLOT, SLOTS, None, False, pool.data_address)


def test_a_gpu_pool_publishes_gpu_addresses_under_the_gpu_rkey(pool: KvPool) -> None:
    st = PoolState(namespace("m", 16), pool, Region(pool.base_address, 1, 99), pb.TIER_GPU)
    assert (st.block_address(3), st.block_rkey) == (pool.slot_address(3), 99)
    st.gpu, st.gpu_rkey = _tier(pool), 1234
    assert (st.block_address(3), st.block_rkey) == (GPU_BASE + 3 * SLOT, 1234)
    info = st.info()
    assert (info.gpu_address, info.gpu_rkey, info.tier) == (GPU_BASE, 1234, pb.TIER_GPU)


def test_gpu_blocks_validate_against_host_headers_and_stop_at_a_reuse(pool: KvPool) -> None:
    got = pool.allocate(6)
    slots, gens = [s for s, _ in got], [g for _, g in got]
    chain = [bytes([i + 1]) * 16 for i in range(6)]
    for s, h, g in zip(slots, chain, gens, strict=True):
        assert pool.mark_stored(s, h, g)
    engine = TransferEngine(["shm"], shared=[pool.mem])
    region = engine.register(pool.view)
    info = apb.PoolInfo(
        header_address=pool.header_address, data_address=pool.data_address, slot_bytes=SLOT,
        slots=SLOTS, rkey=region.rkey, gpu_address=GPU_BASE, gpu_rkey=55,
    )  # fmt: skip
    m = dataclasses.replace(
        _match("a", 6, pb.TIER_GPU),
        addresses=b"".join(struct.pack("<Q", GPU_BASE + s * SLOT) for s in slots),
        generations=struct.pack("<6Q", *gens),
    )
    src = _sources(info, m, 6, SLOT)
    assert src.gpu and src.host_addresses == [pool.slot_address(s) for s in slots]
    _, channel = engine.open_channel([Descriptor(d.name, d.params) for d in engine.descriptors()])
    try:
        assert valid_prefix(_headers(channel, info, src, 1.0), chain, src.generations) == 6
        pool.evict(slots[4])  # reused after the directory recorded it: generation first
        assert valid_prefix(_headers(channel, info, src, 1.0), chain, src.generations) == 4
    finally:
        channel.close()
        engine.close()


def test_an_address_outside_the_holders_pool_ends_the_prefix() -> None:
    info = apb.PoolInfo(slot_bytes=SLOT, slots=4, gpu_address=GPU_BASE, gpu_rkey=1, rkey=2)
    src = _sources(info, _match("a", 6, pb.TIER_GPU), 6, SLOT)
    assert len(src.addresses) == 4  # slots 4 and 5 are past the holder's pool


def _cfg(**over: object) -> AgentConfig:
    raw: dict[str, object] = {
        "node_id": "n", "host": "127.0.0.1", "directory": ["127.0.0.1:1"],
        "listen": "127.0.0.1:2", "engine_socket": "/tmp/s",
        "pools": [{"model": "m", "block_tokens": 16, "slot_bytes": SLOT, "slots": 4,
                   "tier": "gpu"}],
    }  # fmt: skip
    raw.update(over)
    return from_dict(raw)


def test_config_gpu_tier_needs_the_cuda_transport_and_rdma_gpu_needs_rdma() -> None:
    with pytest.raises(ConfigError, match="needs 'cuda'"):
        _cfg()
    assert _cfg(transports=["shm", "tcp", "cuda"]).pools[0].tier == "gpu"
    with pytest.raises(ConfigError, match="rdma_gpu needs 'rdma'"):
        _cfg(transports=["cuda"], rdma_gpu=True)
