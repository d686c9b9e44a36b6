"""The KV pool file: geometry, slot headers, generations and the validation protocol.

Everything runs against real pool files in a temporary directory, mapped
MAP_SHARED (the same code path the agent and the engine library use); no
sockets. The last section drives the real `Fetcher` over a real `ShmChannel`
between two pool files, with a test double standing in for the directory (it
answers `lookup` with the holder records a test chose), so the
read-data-then-header validation is checked byte for byte without a network.
"""

from __future__ import annotations

import os
import random
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.agent.fetcher import Fetcher, FetchError, Peer, PeerCache
from kvdir.agent.pool import (
    ALLOCATED,
    FREE,
    HEADER_BYTES,
    STORED,
    Geometry,
    KvPool,
    PoolError,
    SlotHeader,
    read_header,
)
from kvdir.core.client import DirectoryClient, namespace
from kvdir.core.wire import HASH_BYTES_MAX, namespace_key
from kvdir.transfer.base import CopyTimedOut, TransferError
from kvdir.transfer.engine import TransferEngine
from kvdir.transfer.memory import PAGE_BYTES, SharedMemory
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb

SLOT_BYTES = 4096
SLOTS = 16
NS_KEY = "unit-model/16"


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[KvPool]:
    p = KvPool.open(str(tmp_path / "pool"), NS_KEY, SLOT_BYTES, SLOTS)
    try:
        yield p
    finally:
        p.close(unlink=False)


# --------------------------------------------------------------- geometry


def test_geometry_is_page_aligned_and_sized() -> None:
    g = Geometry.of(SLOT_BYTES, SLOTS)
    assert g.header_offset == PAGE_BYTES
    assert g.data_offset % PAGE_BYTES == 0
    assert g.data_offset >= g.header_offset + SLOTS * HEADER_BYTES
    assert g.size == g.data_offset + SLOTS * SLOT_BYTES
    many = Geometry.of(100, 1000)  # 64,000 header bytes span several pages
    assert many.data_offset == -(-(PAGE_BYTES + 1000 * HEADER_BYTES) // PAGE_BYTES) * PAGE_BYTES


@pytest.mark.parametrize(("slot_bytes", "slots"), [(0, 1), (1, 0), (-1, 4), (4096, -2)])
def test_geometry_rejects_empty_shapes(slot_bytes: int, slots: int) -> None:
    with pytest.raises(PoolError, match="must be > 0"):
        Geometry.of(slot_bytes, slots)


def test_new_pool_is_all_free_and_addressable(pool: KvPool) -> None:
    assert pool.free_slots == SLOTS
    assert all(pool.header(s) == SlotHeader(0, FREE, b"") for s in range(SLOTS))
    assert pool.data_address - pool.header_address == pool.geometry.data_offset - PAGE_BYTES
    assert pool.slot_address(3) == pool.data_address + 3 * SLOT_BYTES
    assert len(pool.slot_view(SLOTS - 1)) == SLOT_BYTES
    assert list(pool.stored()) == []


@pytest.mark.parametrize("slot", [-1, SLOTS, SLOTS + 100])
def test_slots_outside_the_pool_are_refused(pool: KvPool, slot: int) -> None:
    with pytest.raises(PoolError, match="outside the pool"):
        pool.header(slot)
    with pytest.raises(PoolError, match="outside the pool"):
        pool.free([0, slot])
    with pytest.raises(PoolError, match="outside the pool"):
        pool.mark_stored(slot, h(1), 1)
    with pytest.raises(PoolError, match="outside the pool"):
        pool.evict(slot)
    assert pool.free_slots == SLOTS  # a refused free released nothing


# ------------------------------------------------------------- allocation


def test_allocate_bumps_generations_and_is_all_or_nothing(pool: KvPool) -> None:
    got = pool.allocate(3)
    assert [s for s, _ in got] == [0, 1, 2]
    assert all(g == 1 for _, g in got)
    assert all(pool.header(s) == SlotHeader(1, ALLOCATED, b"") for s, _ in got)
    assert pool.free_slots == SLOTS - 3
    with pytest.raises(PoolError, match=f"asked for {SLOTS} slots, {SLOTS - 3} free"):
        pool.allocate(SLOTS)
    assert pool.free_slots == SLOTS - 3  # nothing was taken by the refused call


def test_free_bumps_the_generation_and_returns_what_was_held(pool: KvPool) -> None:
    (s, g), (t, _) = pool.allocate(2)
    assert pool.mark_stored(s, h(7), g)
    freed = pool.free([s, t, t])  # the repeat of t is already free: skipped
    assert freed == [(s, SlotHeader(g, STORED, h(7))), (t, SlotHeader(1, ALLOCATED, b""))]
    assert pool.header(s) == SlotHeader(g + 1, FREE, b"")
    assert pool.free([s]) == []  # freeing a free slot is a no-op
    assert pool.header(s).generation == g + 1
    again = dict(pool.allocate(2))
    assert set(again) == {s, t}
    assert again[s] == g + 2  # every life of a slot has its own generation


def test_mark_stored_only_under_the_current_generation(pool: KvPool) -> None:
    ((s, g),) = pool.allocate(1)
    assert not pool.mark_stored(s, h(1), g - 1)  # stale
    assert not pool.mark_stored(s, h(1), g + 1)  # from the future
    assert pool.mark_stored(s, h(1), g)
    assert pool.header(s) == SlotHeader(g, STORED, h(1))
    assert list(pool.stored()) == [(s, SlotHeader(g, STORED, h(1)))]
    pool.free([s])
    assert not pool.mark_stored(s, h(1), g + 1)  # a free slot never becomes STORED


def test_mark_stored_many_marks_the_current_ones_and_leaves_the_rest(pool: KvPool) -> None:
    got = pool.allocate(5)
    slots = [s for s, _ in got]
    gens = [g for _, g in got]
    assert pool.generations(slots) == gens
    gens[1] -= 1  # stale
    pool.free([slots[3]])  # freed since
    hashes = [h(10), h(11), b"short", h(13), h(14)]  # hash lengths may differ
    assert pool.mark_stored_many(slots, hashes, gens) == [0, 2, 4]
    assert pool.header(slots[0]) == SlotHeader(gens[0], STORED, h(10))
    assert pool.header(slots[2]) == SlotHeader(gens[2], STORED, b"short")
    assert pool.header(slots[1]).state != STORED and pool.header(slots[3]).state != STORED
    # One length for all: the packed path writes the same headers.
    more = pool.allocate(3)
    keep = pool.mark_stored_many([s for s, _ in more], [h(20), h(21), h(22)], [g for _, g in more])
    assert keep == [0, 1, 2]
    assert [pool.header(s).block_hash for s, _ in more] == [h(20), h(21), h(22)]
    with pytest.raises(PoolError, match="outside the pool"):
        pool.mark_stored_many([10**9], [h(1)], [1])
    with pytest.raises(PoolError, match="outside the pool"):
        pool.generations([-1])


@pytest.mark.parametrize("size", [0, HASH_BYTES_MAX + 1])
def test_mark_stored_refuses_bad_hash_lengths(pool: KvPool, size: int) -> None:
    ((s, g),) = pool.allocate(1)
    with pytest.raises(PoolError, match=f"block hash of {size} bytes"):
        pool.mark_stored(s, b"x" * size, g)


def test_full_width_hashes_round_trip(pool: KvPool) -> None:
    ((s, g),) = pool.allocate(1)
    long_hash = bytes(range(HASH_BYTES_MAX))
    assert pool.mark_stored(s, long_hash, g)
    assert pool.header(s).block_hash == long_hash


def test_evict_invalidates_the_published_generation(pool: KvPool) -> None:
    ((s, g),) = pool.allocate(1)
    assert pool.mark_stored(s, h(1), g)
    new = pool.evict(s)
    assert new == g + 1
    assert pool.header(s) == SlotHeader(new, ALLOCATED, b"")
    assert list(pool.stored()) == []
    # Re-storing the same block in the same slot (ABA) lands under the new
    # generation, so a reader holding the old published generation still misses.
    assert not pool.mark_stored(s, h(1), g)
    assert pool.mark_stored(s, h(1), new)
    assert pool.header(s).generation != g


def test_generations_reads_every_slot(pool: KvPool) -> None:
    got = pool.allocate(4)
    pool.evict(got[2][0])
    assert pool.generations([s for s, _ in got]) == [1, 1, 2, 1]
    with pytest.raises(PoolError, match="outside the pool"):
        pool.generations([0, SLOTS])


# ------------------------------------------------------------ persistence


def test_reopening_keeps_headers_data_and_the_free_list(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    got = first.allocate(5)
    for i, (s, g) in enumerate(got[:3]):
        first.slot_view(s)[:] = bytes([i + 1]) * SLOT_BYTES
        assert first.mark_stored(s, h(i), g)
    first.free([got[4][0]])
    inode = os.stat(path).st_ino
    first.close(unlink=False)

    again = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        assert os.stat(path).st_ino == inode  # attached, not recreated
        stored = list(again.stored())
        assert [(s, hd.block_hash) for s, hd in stored] == [
            (s, h(i)) for i, (s, _) in enumerate(got[:3])
        ]
        for i, (s, _) in enumerate(got[:3]):
            assert bytes(again.slot_view(s)) == bytes([i + 1]) * SLOT_BYTES
        # 3 stored + 1 allocated are in use; the freed one is free again.
        assert again.free_slots == SLOTS - 4
        taken = {s for s, _ in again.allocate(SLOTS - 4)}
        assert taken.isdisjoint(s for s, _ in got[:4])
    finally:
        again.close(unlink=False)


@pytest.mark.parametrize("slot_bytes", [64, 1000, PAGE_BYTES + 8])
def test_reopening_a_pool_whose_size_is_not_whole_pages(tmp_path: Path, slot_bytes: int) -> None:
    """The file is created rounded up to whole pages; re-attaching must still match it
    (a mismatch here made every agent restart wipe such a pool)."""
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, slot_bytes, 3)
    assert first.geometry.size % PAGE_BYTES != 0
    ((s, g),) = first.allocate(1)
    first.slot_view(s)[:] = b"\x42" * slot_bytes
    assert first.mark_stored(s, h(1), g)
    first.close(unlink=False)
    again = KvPool.open(path, NS_KEY, slot_bytes, 3)
    try:
        assert list(again.stored()) == [(s, SlotHeader(g, STORED, h(1)))]
        assert bytes(again.slot_view(s)) == b"\x42" * slot_bytes
    finally:
        again.close(unlink=False)


@pytest.mark.parametrize(
    ("ns_key", "slot_bytes", "slots"),
    [
        ("other-model/16", SLOT_BYTES, SLOTS),
        (NS_KEY, 2 * SLOT_BYTES, SLOTS),
        (NS_KEY, SLOT_BYTES, 8),
    ],
)
def test_a_pool_of_another_shape_or_namespace_is_recreated(
    tmp_path: Path, ns_key: str, slot_bytes: int, slots: int
) -> None:
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    ((s, g),) = first.allocate(1)
    assert first.mark_stored(s, h(1), g)
    first.close(unlink=False)
    other = KvPool.open(path, ns_key, slot_bytes, slots)
    try:
        assert list(other.stored()) == []
        assert other.free_slots == slots
    finally:
        other.close(unlink=False)


def test_a_corrupt_superblock_is_not_trusted(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    first = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    ((s, g),) = first.allocate(1)
    assert first.mark_stored(s, h(1), g)
    first.mem.mm[0:8] = b"NOTAPOOL"
    first.close(unlink=False)
    again = KvPool.open(path, NS_KEY, SLOT_BYTES, SLOTS)
    try:
        assert list(again.stored()) == []
    finally:
        again.close(unlink=False)


def test_a_namespace_too_long_for_the_superblock_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="does not fit"):
        KvPool.open(str(tmp_path / "pool"), "m" * PAGE_BYTES, SLOT_BYTES, SLOTS)


def test_two_mappings_of_one_pool_see_each_others_writes(pool: KvPool) -> None:
    """The engine library maps the agent's pool read-write: headers and data are shared."""
    mem = SharedMemory.open_readwrite(pool.mem.path, owner=False)
    engine = KvPool(mem, Geometry.of(SLOT_BYTES, SLOTS), "")
    try:
        ((s, g),) = pool.allocate(1)  # the agent allocates
        assert engine.header(s) == SlotHeader(g, ALLOCATED, b"")
        engine.slot_view(s)[:] = b"\x5a" * SLOT_BYTES  # the engine writes KV
        assert engine.mark_stored(s, h(9), g)
        assert pool.header(s) == SlotHeader(g, STORED, h(9))
        assert bytes(pool.slot_view(s)) == b"\x5a" * SLOT_BYTES
        new = engine.evict(s)  # the engine evicts
        assert pool.header(s) == SlotHeader(new, ALLOCATED, b"")
    finally:
        engine.close(unlink=False)


# ------------------------------------------------------- property: headers


@dataclass
class _Model:
    generation: int = 0
    state: int = FREE
    block_hash: bytes = b""


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 4), st.just(0)),
        st.tuples(st.just("free"), st.integers(0, 7), st.integers(0, 7)),
        st.tuples(st.just("store"), st.integers(0, 7), st.integers(-1, 1)),
        st.tuples(st.just("evict"), st.integers(0, 7), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_headers_follow_the_slot_life_cycle(ops: list[tuple[str, int, int]]) -> None:
    """Random allocate/free/store/evict sequences against a model of the headers.

    Invariants: every allocate, free (of a used slot) and evict bumps the
    generation by one; a block is STORED only when marked under the current
    generation; the free list matches the FREE headers; a reopened pool
    rebuilds the same state from the file alone.
    """
    slots = 8
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pool")
        p = KvPool.open(path, NS_KEY, 64, slots)
        model = [_Model() for _ in range(slots)]
        for n, (op, a, b) in enumerate(ops):
            if op == "allocate":
                free = sum(1 for m in model if m.state == FREE)
                if a > free:
                    with pytest.raises(PoolError):
                        p.allocate(a)
                    continue
                for s, g in p.allocate(a):
                    m = model[s]
                    assert m.state == FREE, "handed out a slot in use"
                    m.generation, m.state, m.block_hash = m.generation + 1, ALLOCATED, b""
                    assert g == m.generation
            elif op == "free":
                wanted = sorted({a, b})
                freed = p.free(wanted)
                assert [s for s, _ in freed] == [s for s in wanted if model[s].state != FREE]
                for s, before in freed:
                    m = model[s]
                    assert before == SlotHeader(m.generation, m.state, m.block_hash)
                    m.generation, m.state, m.block_hash = m.generation + 1, FREE, b""
            elif op == "store":
                m = model[a]
                gen = m.generation + b  # b: -1 stale, 0 current, +1 not yet issued
                ok = p.mark_stored(a, h(n), gen)
                assert ok == (m.state != FREE and b == 0)
                if ok:
                    m.state, m.block_hash = STORED, h(n)
            elif op == "evict" and model[a].state != FREE:  # an engine evicts only its slots
                m = model[a]
                assert p.evict(a) == m.generation + 1
                m.generation, m.state, m.block_hash = m.generation + 1, ALLOCATED, b""
            for s, m in enumerate(model):
                assert p.header(s) == SlotHeader(m.generation, m.state, m.block_hash)
            assert p.free_slots == sum(1 for m in model if m.state == FREE)
        want = [(s, SlotHeader(m.generation, STORED, m.block_hash)) for s, m in enumerate(model)]
        want = [w for w in want if model[w[0]].state == STORED]
        assert list(p.stored()) == want
        p.close(unlink=False)
        again = KvPool.open(path, NS_KEY, 64, slots)
        assert list(again.stored()) == want
        assert again.free_slots == sum(1 for m in model if m.state == FREE)
        again.close(unlink=True)


# ------------------------------------------- the validation protocol (fetch)

BLOCK_TOKENS = 16
NS = namespace("unit-fetch", BLOCK_TOKENS)


@dataclass
class _Published:
    addresses: list[int]
    lengths: list[int]
    rkeys: list[int]
    generations: list[int]


class _DirectoryDouble:
    """Test double for DirectoryClient: `lookup` answers with one holder's records.

    It records what the fetcher asked so a test can check the request too.
    """

    def __init__(self, node_id: str, endpoint: str) -> None:
        self.node_id = node_id
        self.endpoint = endpoint
        self.published: _Published | None = None
        self.asked: list[tuple[list[bytes], str]] = []

    def lookup(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        max_nodes: int = 0,
        exclude_node: str = "",
        linearizable: bool = False,
        address: str | None = None,
        omit_records: bool = False,
    ) -> pb.LookupResponse:
        self.asked.append((list(chain), exclude_node))
        resp = pb.LookupResponse()
        rec = self.published
        if rec is None or not rec.addresses:
            return resp
        resp.matches.add(
            node_id=self.node_id,
            prefix_blocks=len(rec.addresses),
            host="127.0.0.1",
            agent_endpoint=self.endpoint,
            transports=["shm"],
            addresses=array("Q", rec.addresses).tobytes(),
            lengths=array("I", rec.lengths).tobytes(),
            rkeys=array("I", rec.rkeys).tobytes(),
            generations=array("Q", rec.generations).tobytes(),
            tiers=bytes([pb.TIER_HOST]) * len(rec.addresses),
        )
        return resp


@dataclass
class _Pair:
    holder: KvPool
    reader: KvPool
    fetcher: Fetcher
    directory: _DirectoryDouble
    rkey: int


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[_Pair]:
    """A holder pool exposed over shm and a reader pool; the reader's peer cache
    is seeded with the holder (what a handshake would have produced)."""
    holder = KvPool.open(str(tmp_path / "holder"), NS_KEY, SLOT_BYTES, SLOTS)
    reader = KvPool.open(str(tmp_path / "reader"), NS_KEY, SLOT_BYTES, SLOTS)
    h_engine = TransferEngine(["shm"], shared=[holder.mem])
    r_engine = TransferEngine(["shm"], shared=[reader.mem])
    region = h_engine.register(holder.view)
    r_engine.register(reader.view)
    name, channel = r_engine.open_channel(h_engine.descriptors())
    assert name == "shm"
    info = apb.PoolInfo(
        namespace=NS,
        header_address=holder.header_address,
        header_bytes=HEADER_BYTES,
        data_address=holder.data_address,
        slot_bytes=SLOT_BYTES,
        slots=SLOTS,
        rkey=region.rkey,
        path=holder.mem.path,
    )
    peers = PeerCache(r_engine, "reader")
    endpoint = "holder-endpoint"
    ns_hex = namespace_key(NS)
    peers.peers[("holder", endpoint)] = Peer("holder", 1, True, {ns_hex: info}, "shm", channel)
    directory = _DirectoryDouble("holder", endpoint)
    fetcher = Fetcher("reader", cast("DirectoryClient", directory), peers, random.Random(3))
    try:
        yield _Pair(holder, reader, fetcher, directory, region.rkey)
    finally:
        channel.close()
        h_engine.close()
        r_engine.close()
        holder.close(unlink=False)
        reader.close(unlink=False)


def _store(pair: _Pair, chain: list[bytes], seed: int) -> tuple[list[int], list[bytes]]:
    """The holder stores `chain` and the directory double publishes it."""
    rng = random.Random(seed)
    got = pair.holder.allocate(len(chain))
    payload = []
    for (s, g), bh in zip(got, chain, strict=True):
        data = rng.randbytes(SLOT_BYTES)
        pair.holder.slot_view(s)[:] = data
        assert pair.holder.mark_stored(s, bh, g)
        payload.append(data)
    slots = [s for s, _ in got]
    pair.directory.published = _Published(
        [pair.holder.slot_address(s) for s in slots],
        [SLOT_BYTES] * len(slots),
        [pair.rkey] * len(slots),
        [g for _, g in got],
    )
    return slots, payload


def _landed(pair: _Pair, dst: list[int]) -> list[bytes]:
    return [bytes(pair.reader.slot_view(s)) for s in dst]


def test_fetch_copies_every_block_and_validates_it(pair: _Pair) -> None:
    chain = [h(i) for i in range(6)]
    _, payload = _store(pair, chain, seed=1)
    dst = [s for s, _ in pair.reader.allocate(6)]
    r = pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert (r.valid_blocks, r.invalidated, r.transport, r.source_node) == (6, 0, "shm", "holder")
    assert r.bytes == 6 * SLOT_BYTES
    assert _landed(pair, dst) == payload
    assert pair.directory.asked == [(chain, "reader")]  # the reader excludes itself


@pytest.mark.parametrize("error", [CopyTimedOut, TransferError])
def test_a_copy_that_may_still_land_retires_the_slots(
    pair: _Pair, error: type[TransferError]
) -> None:
    """A device copy given up at its deadline (CopyTimedOut, raised here after the data
    read as a timed-out kernel wait would be) may still write the slots: the fetch
    reports nothing valid and the slots retired, so the engine never reuses them. Any
    other transfer failure is a plain miss."""
    chain = [h(i) for i in range(4)]
    _store(pair, chain, seed=5)
    dst = [s for s, _ in pair.reader.allocate(4)]

    def stuck() -> None:
        raise error("cuda read did not complete in time")

    pair.fetcher.after_data = stuck
    r = pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert r.valid_blocks == 0
    assert r.slots_retired is (error is CopyTimedOut)


def _race(pair: _Pair, action: Callable[[KvPool, int], None], j: int) -> None:
    """Run `action` on the holder's slot j between the data read and the header read."""
    chain = [h(i) for i in range(6)]
    slots, payload = _store(pair, chain, seed=2)
    dst = [s for s, _ in pair.reader.allocate(6)]
    fired: list[int] = []

    def hook() -> None:
        fired.append(1)
        action(pair.holder, slots[j])

    pair.fetcher.after_data = hook
    r = pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert fired == [1]
    assert r.valid_blocks == j
    assert r.invalidated == 6 - j
    assert pair.fetcher.validation_failures == 1
    assert _landed(pair, dst)[:j] == payload[:j]


def _evict_and_overwrite(p: KvPool, s: int) -> None:
    p.evict(s)
    p.slot_view(s)[:] = b"\xee" * SLOT_BYTES


def _evict_and_restore_same_block(p: KvPool, s: int) -> None:
    """ABA: the slot is evicted, rewritten and holds the same hash again."""
    old = p.header(s).block_hash
    new = p.evict(s)
    p.slot_view(s)[:] = b"\xee" * SLOT_BYTES
    assert p.mark_stored(s, old, new)


def _free_and_reallocate(p: KvPool, s: int) -> None:
    p.free([s])
    (t, g), *_ = p.allocate(1)
    assert t == s
    p.slot_view(s)[:] = b"\xee" * SLOT_BYTES
    assert p.mark_stored(s, b"another block", g)


@pytest.mark.parametrize(
    "action", [_evict_and_overwrite, _evict_and_restore_same_block, _free_and_reallocate]
)
@pytest.mark.parametrize("j", [0, 3, 5])
def test_a_slot_reused_during_the_fetch_ends_the_valid_prefix(
    pair: _Pair, action: Callable[[KvPool, int], None], j: int
) -> None:
    _race(pair, action, j)


def test_a_published_generation_that_is_already_stale_is_a_miss(pair: _Pair) -> None:
    chain = [h(i) for i in range(4)]
    slots, payload = _store(pair, chain, seed=3)
    pair.holder.evict(slots[2])  # the removal has not reached the directory yet
    dst = [s for s, _ in pair.reader.allocate(4)]
    r = pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert (r.valid_blocks, r.invalidated) == (2, 2)
    assert _landed(pair, dst)[:2] == payload[:2]


def test_a_hash_that_does_not_match_the_chain_is_a_miss(pair: _Pair) -> None:
    stored = [h(0), h(1), h(99)]
    _store(pair, stored, seed=4)
    asked = [h(0), h(1), h(2)]  # a directory answer for a different block 2
    dst = [s for s, _ in pair.reader.allocate(3)]
    r = pair.fetcher.fetch(NS, pair.reader, asked, dst)
    assert (r.valid_blocks, r.invalidated) == (2, 1)


def test_a_holder_block_larger_than_our_slot_ends_the_prefix(pair: _Pair) -> None:
    chain = [h(i) for i in range(3)]
    _store(pair, chain, seed=5)
    assert pair.directory.published is not None
    pair.directory.published.lengths[1] = SLOT_BYTES + 1
    dst = [s for s, _ in pair.reader.allocate(3)]
    r = pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert (r.valid_blocks, r.invalidated) == (1, 0)


def test_nobody_holding_the_chain_is_an_empty_result(pair: _Pair) -> None:
    dst = [s for s, _ in pair.reader.allocate(2)]
    r = pair.fetcher.fetch(NS, pair.reader, [h(0), h(1)], dst)
    assert (r.valid_blocks, r.bytes, r.source_node) == (0, 0, "")


@pytest.mark.parametrize(
    ("chain", "dst", "error", "match"),
    [
        ([h(0), h(1)], [0], FetchError, "2 blocks but 1 destination slots"),
        ([h(0), h(1)], [4, 4], FetchError, "destination slots repeat"),
        ([h(0)], [SLOTS], PoolError, "outside the pool"),
    ],
)
def test_bad_fetch_requests_are_refused_before_any_lookup(
    pair: _Pair, chain: list[bytes], dst: list[int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pair.fetcher.fetch(NS, pair.reader, chain, dst)
    assert pair.directory.asked == []


def test_read_header_decodes_what_the_pool_wrote(pool: KvPool) -> None:
    ((s, g),) = pool.allocate(1)
    assert pool.mark_stored(s, h(42), g)
    raw = bytes(pool.view[pool.header_offset(s) : pool.header_offset(s) + HEADER_BYTES])
    assert read_header(raw) == SlotHeader(g, STORED, h(42))
