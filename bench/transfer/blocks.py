"""The bytes of a fetch: fill blocks distinctly, poison destinations, compare with memcmp.

Each block gets a rotated random tile with every page stamped (nonce, offset),
so a fetch that moved the wrong block, the wrong page or nothing at all fails
the byte-for-byte check.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

from bench.transfer.config import MIB
from kvdir.transfer.memory import buffer_address

PAGE = 4096
POISON = b"\xee" * 16
_STAMP = struct.Struct("<QQ")
_libc = ctypes.CDLL(None)
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcmp.restype = ctypes.c_int


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """memcmp of two writable buffers (a memoryview `==` is element by element: slow)."""
    if len(a) != len(b):
        return False
    return int(_libc.memcmp(buffer_address(a), buffer_address(b), len(a))) == 0


def fill_block(view: memoryview, seed: bytes, nonce: int, index: int) -> None:
    """Distinct bytes per block and per page: a rotated random tile, each page stamped."""
    n, tile = len(view), len(seed) // 2
    rot = (index * 4099 + nonce) % tile
    src = memoryview(seed)[rot : rot + tile]
    for pos in range(0, n, tile):
        k = min(tile, n - pos)
        view[pos : pos + k] = src[:k]
    for pos in range(0, n - _STAMP.size + 1, PAGE):
        _STAMP.pack_into(view, pos, nonce ^ index, pos)


def poison(view: memoryview) -> None:
    """Scribble on a destination so a fetch that moved nothing fails verification."""
    n = len(view)
    for pos in range(0, n - len(POISON) + 1, MIB):
        view[pos : pos + len(POISON)] = POISON
    view[n - len(POISON) : n] = POISON


def segments(src_slots: Sequence[int], dst_slots: Sequence[int]) -> int:
    """How many reads the transfer's coalescing leaves (runs adjacent on both sides)."""
    pairs = sorted(zip(src_slots, dst_slots, strict=True))
    return sum(
        1
        for i, (a, b) in enumerate(pairs)
        if i == 0 or (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1) != (a, b)
    )
