"""Raft's current term and vote, durable before any message reflecting them is sent.

Raft's safety needs `currentTerm` and `votedFor` on stable storage before a
vote is granted or requested (a replica that forgets its vote can vote twice
in one term: two leaders). `set_term` therefore returns only after an
fdatasync, in every durability mode; elections are rare, so the cost is too.

The file holds two fixed 512-byte slots, written alternately in place: a
write lands in the slot *not* holding the newest state, so a power cut that
tears it leaves the previous state (the last one that was synced, hence the
last one acted upon) intact in the other. Each slot::

    u32 magic | u16 format | u16 vote length | u64 sequence | u64 term |
    u64 commit index | vote bytes | zero padding | u32 CRC-32 of the rest

The commit index rides along (pysyncobj restarts from it): it is kept in
memory and written about once a second (`flush_commit`), after the log it
points into is synced, so it never names an entry the log may have lost.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

from kvdir.directory.consensus.sync import REAL, Syncer, write_all, write_atomically
from kvdir.directory.limits import RAFT_VOTE_ID_BYTES_MAX

TERM_FILE = "raft-term.bin"
"""The term file in a data dir."""
SLOT_BYTES = 512
_MAGIC = 0x4D54564B  # b"KVTM" little-endian
_FORMAT = 1
_HEAD = struct.Struct("<IHHQQQ")
_CRC = struct.Struct("<I")
assert _HEAD.size + RAFT_VOTE_ID_BYTES_MAX + _CRC.size <= SLOT_BYTES
INITIAL_COMMIT_INDEX = 1
"""pysyncobj's own default: entry 1 is the no-op every log starts with."""


class TermFileCorrupt(RuntimeError):
    """Neither slot of the term file is intact: the vote is unknown."""


@dataclass(frozen=True, slots=True)
class TermState:
    seq: int = 0
    term: int = 0
    voted_for: str | None = None
    commit_index: int = INITIAL_COMMIT_INDEX


def encode_slot(state: TermState) -> bytes:
    vote = b"" if state.voted_for is None else state.voted_for.encode()
    if len(vote) > RAFT_VOTE_ID_BYTES_MAX:
        raise ValueError(f"a node id of {len(vote)} bytes is over RAFT_VOTE_ID_BYTES_MAX")
    flag = 0 if state.voted_for is None else 1
    head = _HEAD.pack(
        _MAGIC, _FORMAT, len(vote) | (flag << 15), state.seq, state.term, state.commit_index
    )
    body = (head + vote).ljust(SLOT_BYTES - _CRC.size, b"\0")
    return body + _CRC.pack(zlib.crc32(body))


def decode_slot(raw: bytes) -> TermState | None:
    """The state in one slot, or None when it is torn, blank or foreign."""
    if len(raw) != SLOT_BYTES:
        return None
    body = raw[: SLOT_BYTES - _CRC.size]
    (crc,) = _CRC.unpack_from(raw, len(body))
    if crc != zlib.crc32(body):
        return None
    magic, fmt, vote_field, seq, term, commit = _HEAD.unpack_from(body)
    if magic != _MAGIC or fmt != _FORMAT:
        return None
    n, has_vote = vote_field & 0x7FFF, bool(vote_field >> 15)
    vote = body[_HEAD.size : _HEAD.size + n].decode() if has_vote else None
    return TermState(seq, term, vote, commit)


def newest(raw: bytes) -> TermState | None:
    """The newest intact slot of a term file's bytes (None if neither is intact)."""
    slots = [decode_slot(raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]) for i in range(2)]
    found = [s for s in slots if s is not None]
    return max(found, key=lambda s: s.seq) if found else None


def read_commit_index(path: str) -> int:
    """The commit index a term file last stored, read without changing it; 0 when unknown."""
    try:
        with open(path, "rb") as f:
            state = newest(f.read(2 * SLOT_BYTES))
    except OSError:
        return 0
    return state.commit_index if state is not None else 0


class TermStore:
    """The term file of one replica (see the module docstring)."""

    def __init__(self, path: str, syncer: Syncer = REAL) -> None:
        self.path = path
        self.syncer = syncer
        if not os.path.exists(path):
            first = TermState()
            write_atomically(path, [encode_slot(first), b"\0" * SLOT_BYTES], syncer)
        with open(path, "rb") as f:
            state = newest(f.read(2 * SLOT_BYTES))
        if state is None:
            raise TermFileCorrupt(
                f"{path}: neither copy of the Raft term and vote is intact; the vote this "
                "replica gave is unknown, so it must not rejoin as it is (docs/operations.md: "
                "`kvdir directory recover`)"
            )
        self._state = state
        self._commit_index = state.commit_index
        self._fd = os.open(path, os.O_RDWR)

    @property
    def term(self) -> int:
        return self._state.term

    @property
    def voted_for(self) -> str | None:
        return self._state.voted_for

    @property
    def commit_index(self) -> int:
        return self._commit_index

    def set_term(self, term: int, voted_for: str | None) -> None:
        """Store term and vote durably; returns only once they are on stable storage."""
        self._store(term, voted_for, self._commit_index)

    def set_commit(self, index: int) -> None:
        """Remember the commit index; stored by the next `flush_commit`."""
        self._commit_index = index

    def flush_commit(self) -> None:
        """Store the commit index if it moved (call after syncing the log)."""
        if self._commit_index != self._state.commit_index:
            self._store(self._state.term, self._state.voted_for, self._commit_index)

    def _store(self, term: int, voted_for: str | None, commit: int) -> None:
        state = TermState(self._state.seq + 1, term, voted_for, commit)
        write_all(self._fd, encode_slot(state), (state.seq % 2) * SLOT_BYTES)
        self.syncer.file(self._fd)
        self._state = state

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


__all__ = [
    "SLOT_BYTES",
    "TERM_FILE",
    "TermFileCorrupt",
    "TermState",
    "TermStore",
    "decode_slot",
    "newest",
    "read_commit_index",
]
