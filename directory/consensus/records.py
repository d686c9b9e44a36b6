"""The journal's on-disk format, and the scan that tells a torn tail from corruption.

Pure: bytes in, entries out; no I/O (`journal.py` does that).

File: a 16-byte header (``FILE_MAGIC``, u32 format version, u32 CRC-32 of
those 12 bytes), then records back to back, little-endian::

    u32 RECORD_MAGIC | u32 crc | u32 length | u64 index | u64 term | u64 synced_to | payload

``crc`` is CRC-32 of everything after it (the other header fields and the
payload). ``synced_to`` is the file offset up to which the journal had been
made durable when this record was written. That field is what separates the
two kinds of damage a journal can show:

- A power cut during a batch's write leaves any part of the *unsynced* tail
  missing or garbled, in any order (pages reach the disk in no particular
  order). Nothing there was acknowledged, so the tail is cut from the first
  bad record on.
- A record that fails its check although a later intact record says the
  journal was synced past it lost bytes that *were* durable: corruption, never
  applied, never cut. The replica stops and says where.

Damage inside the last synced batches that no later record vouches for is
indistinguishable from a torn write and is cut (as in any write-ahead log).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from kvdir.directory.limits import JOURNAL_RECORD_BYTES_MAX

Entry = tuple[bytes, int, int]
"""(payload, index, term): a Raft log entry as pysyncobj keeps it."""

FILE_MAGIC = b"KVDJRNL\x00"
FORMAT_VERSION = 1
_FILE_HEAD = struct.Struct("<8sI")
_FILE_CRC = struct.Struct("<I")
HEADER_BYTES = _FILE_HEAD.size + _FILE_CRC.size

RECORD_MAGIC = 0x4C4A564B  # b"KVJL" little-endian
_MAGIC_BYTES = struct.pack("<I", RECORD_MAGIC)
_REC_HEAD = struct.Struct("<II")  # magic, crc
_REC_BODY = struct.Struct("<IQQQ")  # length, index, term, synced_to
RECORD_OVERHEAD_BYTES = _REC_HEAD.size + _REC_BODY.size


def file_header() -> bytes:
    head = _FILE_HEAD.pack(FILE_MAGIC, FORMAT_VERSION)
    return head + _FILE_CRC.pack(zlib.crc32(head))


def header_problem(buf: bytes) -> str:
    """Why `buf` does not start with a journal header this version reads ("" if it does)."""
    if len(buf) < HEADER_BYTES:
        return f"the file is {len(buf)} bytes, shorter than a journal header"
    magic, version = _FILE_HEAD.unpack_from(buf)
    (crc,) = _FILE_CRC.unpack_from(buf, _FILE_HEAD.size)
    if magic != FILE_MAGIC or crc != zlib.crc32(buf[: _FILE_HEAD.size]):
        return "the file header is not a kvdir journal header"
    if version != FORMAT_VERSION:
        return f"journal format {version} is not supported (this version reads {FORMAT_VERSION})"
    return ""


def encode(index: int, term: int, synced_to: int, payload: bytes) -> bytes:
    """One record. `synced_to`: the durable frontier when the record is written."""
    if len(payload) > JOURNAL_RECORD_BYTES_MAX:
        raise ValueError(
            f"a log entry of {len(payload)} bytes is over JOURNAL_RECORD_BYTES_MAX "
            f"({JOURNAL_RECORD_BYTES_MAX})"
        )
    body = _REC_BODY.pack(len(payload), index, term, synced_to)
    crc = zlib.crc32(payload, zlib.crc32(body))
    return _REC_HEAD.pack(RECORD_MAGIC, crc) + body + payload


@dataclass(frozen=True, slots=True)
class Record:
    entry: Entry
    synced_to: int
    end: int
    """Offset just past this record."""


def parse_at(buf: bytes, pos: int) -> Record | str:
    """The record at `pos`, or why there is none (a short, garbled or foreign one)."""
    if pos + RECORD_OVERHEAD_BYTES > len(buf):
        return "a record header runs past the end of the file"
    magic, crc = _REC_HEAD.unpack_from(buf, pos)
    if magic != RECORD_MAGIC:
        return "no record marker"
    length, index, term, synced_to = _REC_BODY.unpack_from(buf, pos + _REC_HEAD.size)
    if length > JOURNAL_RECORD_BYTES_MAX:
        return f"record length {length} is over the limit"
    start = pos + RECORD_OVERHEAD_BYTES
    end = start + length
    if end > len(buf):
        return "the record runs past the end of the file"
    payload = buf[start:end]
    body = buf[pos + _REC_HEAD.size : start]
    if zlib.crc32(payload, zlib.crc32(body)) != crc:
        return "checksum mismatch"
    return Record((payload, index, term), synced_to, end)


@dataclass(slots=True)
class Scan:
    """What a journal file holds: the intact prefix, and what stopped it."""

    entries: list[Entry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """File offset of each entry's record."""
    end: int = HEADER_BYTES
    """Where the intact prefix ends (a record boundary)."""
    damage: str = ""
    """Why the bytes at `end` were not accepted ("" when the file ends there)."""
    witness: int | None = None
    """Offset of a later intact record written after the journal had been synced
    past `end`: the damage lost durable bytes (corruption, not a torn write)."""

    @property
    def corrupt(self) -> bool:
        return self.witness is not None


def _sequencing_problem(entry: Entry, last: Entry | None) -> str:
    if last is None:
        return ""
    if entry[1] != last[1] + 1:
        return f"index {entry[1]} follows index {last[1]}"
    if entry[2] < last[2]:
        return f"term {entry[2]} follows term {last[2]} (terms never decrease)"
    return ""


def scan(buf: bytes) -> Scan:
    """Read every intact record of a journal file (`buf`: the whole file, header included).

    Raises ValueError if the header itself is bad (a journal without one was
    never written by `journal.py`, which creates files atomically).
    """
    problem = header_problem(buf)
    if problem:
        raise ValueError(problem)
    out = Scan()
    pos, last = HEADER_BYTES, None
    while pos < len(buf):
        rec = parse_at(buf, pos)
        why = rec if isinstance(rec, str) else _sequencing_problem(rec.entry, last)
        if why:
            out.end, out.damage = pos, why
            out.witness = find_witness(buf, pos, last)
            return out
        assert isinstance(rec, Record)
        out.entries.append(rec.entry)
        out.offsets.append(pos)
        last, pos = rec.entry, rec.end
    out.end = pos
    return out


def find_witness(buf: bytes, bad_at: int, last: Entry | None) -> int | None:
    """A later intact record proving the journal was synced past `bad_at`, or None.

    A candidate must be a plausible successor (a later index, no lower term)
    and claim no durability beyond its own position, so bytes inside a
    payload that happen to look like a record are not taken for one.
    """
    pos = buf.find(_MAGIC_BYTES, bad_at + 1)
    while pos != -1:
        rec = parse_at(buf, pos)
        if (
            isinstance(rec, Record)
            and bad_at < rec.synced_to <= pos
            and (last is None or (rec.entry[1] > last[1] and rec.entry[2] >= last[2]))
        ):
            return pos
        pos = buf.find(_MAGIC_BYTES, pos + 1)
    return None


__all__ = [
    "HEADER_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "Entry",
    "Record",
    "Scan",
    "encode",
    "file_header",
    "find_witness",
    "header_problem",
    "parse_at",
    "scan",
]
