"""transfer.memory: the holder's rkey registry and shared-memory files (no sockets)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdir.transfer.base import AccessDenied
from kvdir.transfer.memory import PAGE_BYTES, Registry, SharedMemory, buffer_address

SIZE = 4096


@pytest.fixture
def buf() -> bytearray:
    return bytearray(random.Random(5).randbytes(SIZE))


def test_resolve_returns_the_registered_bytes(buf: bytearray) -> None:
    reg = Registry(random.Random(1))
    mv = memoryview(buf)
    region = reg.register(mv)
    assert region.address == buffer_address(mv)
    assert region.length == SIZE
    assert region.rkey != 0
    assert bytes(reg.resolve(region.address, region.rkey, SIZE)) == bytes(buf)
    assert bytes(reg.resolve(region.address + 100, region.rkey, 8)) == bytes(buf[100:108])
    buf[100] ^= 0xFF  # a view, not a copy: later writes show through
    assert reg.resolve(region.address + 100, region.rkey, 1)[0] == buf[100]


def test_an_rkey_never_granted_is_denied(buf: bytearray) -> None:
    reg = Registry(random.Random(1))
    region = reg.register(memoryview(buf))
    with pytest.raises(AccessDenied, match="was never granted"):
        reg.resolve(region.address, region.rkey ^ 1, 8)
    with pytest.raises(AccessDenied, match="was never granted"):
        reg.resolve(region.address, 0, 8)


@pytest.mark.parametrize(
    ("offset", "length"), [(-1, 8), (SIZE - 4, 8), (SIZE, 1), (0, SIZE + 1), (0, 0), (10, -5)]
)
def test_ranges_outside_the_region_are_denied(buf: bytearray, offset: int, length: int) -> None:
    reg = Registry(random.Random(1))
    region = reg.register(memoryview(buf))
    with pytest.raises(AccessDenied, match="outside the region"):
        reg.resolve(region.address + offset, region.rkey, length)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(-64, SIZE + 64), length=st.integers(-8, SIZE + 64))
def test_resolve_grants_exactly_the_ranges_inside(offset: int, length: int) -> None:
    data = bytearray(random.Random(offset).randbytes(SIZE))
    reg = Registry(random.Random(2))
    region = reg.register(memoryview(data))
    inside = length > 0 and offset >= 0 and offset + length <= SIZE
    if inside:
        got = reg.resolve(region.address + offset, region.rkey, length)
        assert bytes(got) == bytes(data[offset : offset + length])
    else:
        with pytest.raises(AccessDenied):
            reg.resolve(region.address + offset, region.rkey, length)


def test_one_buffer_has_one_rkey_and_buffers_do_not_share_keys() -> None:
    reg = Registry(random.Random(3))
    a, b = bytearray(64), bytearray(64)
    ra = reg.register(memoryview(a))
    assert reg.register(memoryview(a)) == ra  # every backend of one engine shares it
    rb = reg.register(memoryview(b))
    assert rb.rkey != ra.rkey
    with pytest.raises(AccessDenied):  # a's key does not open b's memory
        reg.resolve(rb.address, ra.rkey, 8)
    assert set(reg.regions()) == {ra, rb}


def test_explicit_rkeys_and_deregistration() -> None:
    reg = Registry(random.Random(4))
    a, b = bytearray(64), bytearray(64)
    ra = reg.register(memoryview(a), rkey=0xABC)
    assert ra.rkey == 0xABC
    with pytest.raises(ValueError, match="already registered"):
        reg.register(memoryview(b), rkey=0xABC)
    reg.deregister(ra.rkey)
    with pytest.raises(AccessDenied, match="was never granted"):
        reg.resolve(ra.address, ra.rkey, 8)
    reg.deregister(ra.rkey)  # twice is fine
    assert reg.regions() == []


def test_a_typed_view_is_registered_by_its_bytes() -> None:
    words = bytearray(range(64))
    reg = Registry(random.Random(6))
    region = reg.register(memoryview(words).cast("I"))
    assert region.length == 64
    assert bytes(reg.resolve(region.address, region.rkey, 64)) == bytes(words)


def test_shared_memory_files_are_page_rounded_and_shared(tmp_path: Path) -> None:
    path = str(tmp_path / "region")
    mem = SharedMemory.create(path, 100)
    try:
        assert mem.size == PAGE_BYTES
        assert os.path.getsize(path) == PAGE_BYTES
        other = SharedMemory.open_readwrite(path, owner=False)
        ro = SharedMemory.open_readonly(path)
        try:
            mem.mm[0:5] = b"hello"
            assert bytes(other.mm[0:5]) == b"hello"
            other.mm[5:10] = b"world"
            assert bytes(ro.mm[0:10]) == b"helloworld"
            with pytest.raises(TypeError):
                ro.mm[0:1] = b"x"
        finally:
            other.close()
            ro.close()
        assert os.path.exists(path)  # non-owners never unlink
    finally:
        mem.close()
    assert not os.path.exists(path)  # the owner does
