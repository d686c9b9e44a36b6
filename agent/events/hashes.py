"""Engine block hashes -> the directory's key bytes.

The directory keys a block by opaque bytes (1..32); unsigned 64-bit ids are
8 bytes big-endian (directory.validate.hashes). Engines send:

==========  ===========================================  ===================
format      what the engine sends                        key
==========  ===========================================  ===================
u64         vLLM's default: the digest's low 64 bits,    8 bytes big-endian
            an unsigned int (>= 2^63 arrives as uint64)  (= digest[-8:])
signed      vLLM 0.9-0.10.1 Python hash() values, and    8 bytes big-endian,
            SGLang's first 8 digest bytes as int64       two's complement
bytes       vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_      the bytes as sent
            HASHES=0: the 32-byte digest
auto        any of the above, told apart per value       as above
==========  ===========================================  ===================

Two's complement makes a signed hash and the unsigned reading of the same 8
bytes one key, so SGLang's int64 of digest[:8] keys as digest[:8] itself.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import StrEnum

from kvdir.agent.events.decode import DecodeError, Hash
from kvdir.core.wire import HASH_BYTES_MAX

U64_MASK = (1 << 64) - 1


class HashFormat(StrEnum):
    AUTO = "auto"
    U64 = "u64"
    SIGNED = "signed"
    BYTES = "bytes"


_INT_PACK = {HashFormat.U64: "Q", HashFormat.SIGNED: "q"}


def _split8(packed: bytes) -> list[bytes]:
    return [packed[i : i + 8] for i in range(0, len(packed), 8)]


def _ints(hashes: Sequence[int], fmt: HashFormat) -> list[bytes]:
    n = len(hashes)
    code = _INT_PACK.get(fmt)
    try:
        if code is not None:
            return _split8(struct.pack(f">{n}{code}", *hashes))
        try:
            return _split8(struct.pack(f">{n}Q", *hashes))
        except struct.error:  # auto with a negative (signed) hash among them
            if min(hashes) < -(1 << 63) or max(hashes) > U64_MASK:
                raise
            return _split8(struct.pack(f">{n}Q", *(h & U64_MASK for h in hashes)))
    except struct.error as e:
        raise DecodeError("bad-hash", f"a block hash is out of range for {fmt}: {e}") from e


def _bytes(hashes: Sequence[bytes]) -> list[bytes]:
    widths = set(map(len, hashes))
    if min(widths) < 1 or max(widths) > HASH_BYTES_MAX:
        raise DecodeError("bad-hash", f"a block hash has {sorted(widths)} bytes (1..32)")
    return list(hashes)


def keys(hashes: Sequence[Hash], fmt: HashFormat = HashFormat.AUTO) -> list[bytes]:
    """Directory keys of a list of engine hashes (one type per list)."""
    if not hashes:
        return []
    kinds = set(map(type, hashes))
    if kinds == {int}:
        if fmt is HashFormat.BYTES:
            raise DecodeError("bad-hash", "integer block hashes where bytes were configured")
        return _ints(hashes, fmt)  # type: ignore[arg-type]
    if kinds == {bytes}:
        if fmt not in (HashFormat.AUTO, HashFormat.BYTES):
            raise DecodeError("bad-hash", f"byte block hashes where {fmt} was configured")
        return _bytes(hashes)  # type: ignore[arg-type]
    raise DecodeError("bad-hash", f"block hashes of types {sorted(k.__name__ for k in kinds)}")


def key(h: Hash, fmt: HashFormat = HashFormat.AUTO) -> bytes:
    return keys([h], fmt)[0]


def u64_of_digest(digest: bytes) -> int:
    """vLLM's int form of a digest: its low 64 bits (maybe_convert_block_hash)."""
    return int.from_bytes(digest, "big") & U64_MASK


def int64_of_digest(digest: bytes) -> int:
    """SGLang's int form of a digest: its first 8 bytes as a signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)
