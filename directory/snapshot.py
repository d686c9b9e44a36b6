"""Snapshot of a `Table` to a file and back, in an explicit binary format.

Compaction must never stall the Raft thread (the Raft library's stock snapshot
pickles the whole state on the tick thread: 3.8 s at 1M entries, which causes
elections; even copying the columns, the key list and the chain heads there
took 0.38 s at 3M entries and cost an election). So a snapshot has three parts:

- `freeze(table)` runs on the Raft thread, between two applies: it copies the
  node records and the namespace names (a few hundred objects) and starts the
  table's copy-on-write (`Table.freeze`). O(nodes), whatever the table's size.
- `Frozen.image()` runs on any other thread: it copies the live columns in
  chunks (the Raft thread gets the GIL back between chunks), then puts back
  the rows that changed since the freeze, and derives each namespace's chain
  heads from the copied columns. Concurrent callers share the one copy.
- `write(image, path)` runs on a background thread and does the slow part,
  releasing the GIL often (chunked joins, file writes), and syncs the file as
  it goes (`DUMP_SYNC_BYTES`) so that its writeback never holds up the
  journal's fdatasync on the Raft thread.

File layout: ``MAGIC``, u32 header length, a JSON header (format version,
sizes, namespaces, nodes, Raft metadata), then each numeric column as raw
little-endian bytes, the key lengths (u8 per slot, 0 for a free slot), the
concatenated keys, each namespace's head slots, and the Raft log entries the
Raft adapter hands us (u32 length, bytes, u64 index, u64 term each). Sizes are
in the header, so a truncated file is detected rather than half-loaded.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import weakref
from array import array
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import compress
from typing import Any, BinaryIO, Protocol

import numpy as np
import numpy.typing as npt

from kvdir.core.shard_map import ShardMap, ShardMapError
from kvdir.directory.block_index import BlockIndex
from kvdir.directory.consensus.sync import REAL, Syncer, replace_durably
from kvdir.directory.shard_fence import ShardFence
from kvdir.directory.table import NIL, Columns, Freeze, NodeState, Table, untracked

MAGIC = b"KVDSNAP\x00"
FORMAT_VERSION = 3  # 2: fingerprint, key-width and sole-holder columns; 3: shard map
FORMATS_READ = (2, 3)
_CHUNK = 1 << 16
COPY_CHUNK_SLOTS = 1 << 16
"""Slots copied per GIL hold by `Frozen.image` (~1 ms: 56 column bytes and a key each)."""

DUMP_SYNC_BYTES = 8 << 20
"""`write` syncs the file each time this many bytes were written since the last sync.

On ext4 (data=ordered) an fdatasync commits the filesystem journal, which first
writes out every dirty data block allocated in that transaction, other files'
included. One fsync of a whole ~190 MB dump (3M entries) at its end held every
Raft journal fdatasync on that disk, on each replica's Raft thread, 200-440 ms:
longer than the 150 ms election timeout, an election at every compaction
(bench/results/directory-compaction-2026-12-04.md). Synced 8 MiB at a time, a
concurrent fdatasync waited 21-30 ms instead of 230-270 ms (bench host, alone)."""

RaftEntry = tuple[bytes, int, int]
_NODE_HEAD, _NODE_ENTRIES = 7, 8
"""Where a node record of `capture` holds its list head and its entry count."""
Slots = npt.NDArray[np.int64]


class Sink(Protocol):
    """Where `write_to` puts a snapshot's bytes (a file, a memory buffer)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> object: ...


class SnapshotError(ValueError):
    """The file is not a snapshot this version can load."""


@dataclass(slots=True)
class Image:
    """A frozen copy of a table, cheap to take, independent of later applies."""

    arrays: list[array[int]]
    keys: list[bytes | None]
    heads: list[array[int]]
    """Per namespace, its chains' head slots (typecode "I": never a list of Python
    ints, whose making held the GIL 184 ms per million heads)."""
    meta: dict[str, Any]


class Frozen:
    """A table captured between two applies (`freeze`), copied out on demand.

    `image()` may be called from any thread, any number of times: the first
    call copies (see the module docstring), later ones return the same Image.
    The table's copy-on-write ends when the copy is done, or when this object
    is dropped uncopied (so an abandoned capture never grows without bound)."""

    def __init__(self, table: Table, meta: dict[str, Any]) -> None:
        self._table = table
        self._freeze = table.freeze()
        self._thaw = weakref.finalize(self, table.thaw, self._freeze)
        self._meta = meta
        self._lock = threading.Lock()
        self._image: Image | None = None

    @property
    def entries(self) -> int:
        n: int = self._meta["entries"]
        return n

    def image(self) -> Image:
        with self._lock:
            if self._image is None:
                try:
                    self._image = _copy(self._freeze, self._meta)
                finally:
                    self._thaw()
            return self._image


def freeze(table: Table) -> Frozen:
    """Capture `table` as it is now; the only part that runs on the Raft thread."""
    nodes = [
        None
        if n is None
        else [
            n.node_id,
            n.host,
            n.endpoint,
            list(n.transports),
            n.incarnation,
            n.lease_ms,
            n.lease_expiry_ms,
            n.head,
            n.entries,
        ]
        for n in table.node_by_idx
    ]
    meta = {
        "format": FORMAT_VERSION,
        "slots": len(table.col),
        "free": table.free,
        "entries": table.entries,
        "namespaces": list(table.ns_names),
        "nodes": nodes,
        "free_node_idx": list(table.free_node_idx),
        "shard_map": None if table.shard_map is None else table.shard_map.to_json(),
        "shard_fence": table.fence.to_json(),
    }
    return Frozen(table, meta)


def capture(table: Table) -> Image:
    """`table`'s image now, copied on this thread (tools, tests, the in-memory port)."""
    return freeze(table).image()


def _copy(f: Freeze, meta: dict[str, Any]) -> Image:
    """The table as frozen in `f`: copy the live columns, then undo later changes.

    Correct with the Raft thread applying meanwhile, because each slice is
    one C call under the GIL and `Table._keep` saves a slot's row before the
    slot first changes: a slot changed before its chunk was copied has its
    saved row in the dict copied after every chunk; a slot changed after was
    copied as it was (and any saved row for it holds the same values). No
    buffer of a live column is held across chunks (an exported buffer would
    make the Raft thread's next append raise).
    """
    n = f.slots
    arrays = [array(a.typecode) for a in f.arrays]
    keys: list[bytes | None] = untracked([])
    for i in range(0, n, COPY_CHUNK_SLOTS):
        j = min(n, i + COPY_CHUNK_SLOTS)
        for out, live in zip(arrays, f.arrays, strict=True):
            out.extend(live[i:j])
        keys.extend(f.keys[i:j])
    for s, row in f.undo.copy().items():
        for out, v in zip(arrays, row, strict=False):
            out[s] = v  # type: ignore[assignment]  # a numeric column's saved value is an int
        keys[s] = row[-1]  # type: ignore[assignment]  # the key's is bytes or None
    cols = Columns.of(arrays, keys)
    return Image(arrays=arrays, keys=keys, heads=_heads(cols, len(meta["namespaces"])), meta=meta)


def table_of(image: Image) -> Table:
    """A Table over `image`'s columns (shared, not copied), for reading: a digest
    taken off the Raft thread. Writing to it would write into the image."""
    table = Table()
    table.col = Columns.of(image.arrays, image.keys)
    _restore_meta(table, image.meta, image.heads)
    return table


def drop(image: Image) -> None:
    """Empty `image`'s key list a chunk at a time (its only owner, once done with it).

    Freeing the list in one go decrefs every key in one C call: 35 ms of GIL
    at 3M entries, taken from the Raft thread (bench host, 2026-12-03)."""
    keys = image.keys
    while keys:
        del keys[-COPY_CHUNK_SLOTS:]


def _heads(c: Columns, namespaces: int) -> list[array[int]]:
    """Each namespace's chain heads, in slot order: the used slots no used slot links to.

    Derived from the columns rather than read from the block indexes, which a
    copy-on-write freeze does not cover (and which cost 70-160 ms per million
    entries to list on the Raft thread)."""
    used = _np(c.node) != NIL
    links = _np(c.bnext)[used]
    head = used.copy()
    head[links[links != NIL].astype(np.int64)] = False
    slots = np.flatnonzero(head)
    ns = _np(c.ns)[slots].astype(np.int64)
    by_ns = slots[np.argsort(ns, kind="stable")]
    ends = np.cumsum(np.bincount(ns, minlength=namespaces)).tolist()
    return [_slots(by_ns[a:b]) for a, b in zip([0, *ends], ends, strict=False)]


def restrict(image: Image, namespaces: Collection[str]) -> Image:
    """`image` with only the entries of `namespaces` and every node: the table
    of the same log with only those namespaces' commands and every node-wide
    one applied (what a namespace-filtered Watch stream carries).

    For a filtered watcher's starting point, on the stream's thread (never the
    Raft thread: the work is proportional to the table, in numpy). `image` is
    left as it was. Free slots are dropped and the kept ones renumbered in
    their order (consecutive runs stay consecutive, which lookups read fast),
    so the free list is empty; the kept namespaces keep their relative order,
    node indexes stay as they are. Each node's list is rebuilt newest slot
    first, as inserts leave it: its order carries no meaning (it only decides
    which freed slot a later insert reuses).
    """
    names: list[str] = image.meta["namespaces"]
    kept_ns = [i for i, name in enumerate(names) if name in namespaces]
    old = Columns.of(image.arrays, image.keys)
    keep = (_np(old.node) != NIL) & np.isin(_np(old.ns), kept_ns)  # used, and watched
    slots = np.flatnonzero(keep)
    renumber = np.full(len(old), NIL, dtype=np.int64)
    renumber[slots] = np.arange(len(slots))
    keys = list(compress(old.key, keep.tolist()))
    new = Columns.of([_take(a, slots) for a in old.arrays()], keys)
    ns_ids = np.zeros(len(names), dtype=np.int64)
    ns_ids[kept_ns] = np.arange(len(kept_ns))
    new.ns = _like(new.ns, ns_ids[_np(new.ns)])
    new.bnext = _like(new.bnext, _follow(renumber, _np(new.bnext)))
    heads = [_slots(_follow(renumber, np.asarray(image.heads[i], np.int64))) for i in kept_ns]
    node_heads, entries = _relink_nodes(new, len(image.meta["nodes"]))
    meta = dict(image.meta)
    meta.update(
        slots=len(slots),
        free=NIL,
        entries=len(slots),
        namespaces=[names[i] for i in kept_ns],
        nodes=[_node_record(r, node_heads[i], entries[i]) for i, r in enumerate(meta["nodes"])],
        free_node_idx=list(meta["free_node_idx"]),
    )
    return Image(arrays=new.arrays(), keys=new.key, heads=heads, meta=meta)


def _np(a: array[int]) -> npt.NDArray[np.unsignedinteger[Any]]:
    """A numpy view of an array column (no copy)."""
    return np.frombuffer(a, dtype=np.dtype(f"u{a.itemsize}"))


def _slots(values: npt.NDArray[Any]) -> array[int]:
    """Slot numbers as a head column ("I"), in one copy."""
    out = array("I")
    out.frombytes(values.astype(np.dtype(f"u{out.itemsize}")).tobytes())
    return out


def _take(a: array[int], slots: Slots) -> array[int]:
    return array(a.typecode, _np(a)[slots].tobytes())


def _like(a: array[int], values: npt.NDArray[Any]) -> array[int]:
    """`values` as a column of `a`'s type."""
    return array(a.typecode, values.astype(np.dtype(f"u{a.itemsize}")).tobytes())


def _follow(renumber: Slots, links: npt.NDArray[Any]) -> Slots:
    """Slot links (NIL: none) in the new numbering; each must point at a kept slot."""
    links = links.astype(np.int64)
    out = np.full(len(links), NIL, dtype=np.int64)
    linked = links != NIL
    out[linked] = renumber[links[linked]]
    assert (out[linked] != NIL).all(), "a chain or head reaches a dropped slot"
    return out


def _relink_nodes(c: Columns, nodes: int) -> tuple[Slots, Slots]:
    """Rebuild every node's list over `c` (newest slot first); (heads, entries) per node."""
    owner = _np(c.node).astype(np.int64)
    newest_first = np.arange(len(owner) - 1, -1, -1, dtype=np.int64)
    order = newest_first[np.argsort(owner[newest_first], kind="stable")]
    same = owner[order[1:]] == owner[order[:-1]]
    nnext = np.full(len(owner), NIL, dtype=np.int64)
    nprev = np.full(len(owner), NIL, dtype=np.int64)
    nnext[order[:-1][same]] = order[1:][same]
    nprev[order[1:][same]] = order[:-1][same]
    c.nnext, c.nprev = _like(c.nnext, nnext), _like(c.nprev, nprev)
    first = np.ones(len(order), dtype=bool)
    first[1:] = ~same
    heads = np.full(nodes, NIL, dtype=np.int64)
    heads[owner[order[first]]] = order[first]
    return heads, np.bincount(owner, minlength=nodes).astype(np.int64)


def _node_record(rec: list[Any] | None, head: np.int64, entries: np.int64) -> list[Any] | None:
    if rec is None:
        return None
    rec = list(rec)
    rec[_NODE_HEAD], rec[_NODE_ENTRIES] = int(head), int(entries)  # JSON takes no numpy ints
    return rec


def _to_le(a: array[int]) -> array[int]:
    if sys.byteorder == "little":
        return a
    b = a[:]
    b.byteswap()
    return b


def _key_chunks(keys: list[bytes | None]) -> Iterator[tuple[bytes, bytes]]:
    for i in range(0, len(keys), _CHUNK):
        chunk = [k or b"" for k in keys[i : i + _CHUNK]]
        yield bytes(len(k) for k in chunk), b"".join(chunk)


def write(
    image: Image,
    path: str,
    raft: dict[str, Any],
    entries: list[RaftEntry],
    syncer: Syncer = REAL,
) -> None:
    """Write `image` (plus the Raft adapter's metadata) atomically and durably to `path`.

    A temp file, fsync, rename, fsync of the directory: a power cut at any
    point leaves the previous snapshot or the whole new one. Returns only
    when the new one is durable, so the log entries it covers may be dropped.
    """
    tmp = path + ".kvdir-tmp"
    with open(tmp, "wb") as f:
        write_to(_SyncedEvery(f, syncer, DUMP_SYNC_BYTES), image, raft, entries)
        f.flush()
        syncer.file(f.fileno())
    replace_durably(tmp, path, syncer)


class _SyncedEvery:
    """A file that is synced after every `every` bytes written to it (`DUMP_SYNC_BYTES`)."""

    def __init__(self, f: BinaryIO, syncer: Syncer, every: int) -> None:
        self._f, self._syncer, self._every = f, syncer, every
        self._unsynced = 0
        self.syncs = 0

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            piece = view[: self._every - self._unsynced]
            self._f.write(piece)
            self._unsynced += len(piece)
            view = view[len(piece) :]
            if self._unsynced >= self._every:
                self._f.flush()
                self._syncer.file(self._f.fileno())  # the GIL is released meanwhile
                self._unsynced = 0
                self.syncs += 1
        return n


def write_to(f: Sink, image: Image, raft: dict[str, Any], entries: list[RaftEntry]) -> None:
    """The snapshot's bytes into an open file (a path, or memory for a Watch stream)."""
    lengths = bytearray()
    blobs: list[bytes] = []
    for lens, blob in _key_chunks(image.keys):
        lengths += lens
        blobs.append(blob)
    header = dict(image.meta)
    header["raft"] = raft
    header["array_bytes"] = [len(a) * a.itemsize for a in image.arrays]
    header["keys_bytes"] = sum(len(b) for b in blobs)
    header["head_counts"] = [len(h) for h in image.heads]
    header["raft_entries"] = len(entries)
    head_bytes = json.dumps(header, separators=(",", ":")).encode()
    f.write(MAGIC)
    f.write(struct.pack("<I", len(head_bytes)))
    f.write(head_bytes)
    for a in image.arrays:
        f.write(memoryview(_to_le(a)).cast("B"))
    f.write(lengths)
    for blob in blobs:
        f.write(blob)
    for h in image.heads:
        f.write(memoryview(_to_le(h)).cast("B"))
    for cmd, idx, term in entries:
        f.write(struct.pack("<I", len(cmd)))
        f.write(cmd)
        f.write(struct.pack("<QQ", idx, term))


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SnapshotError("snapshot is truncated")
    return data


def _read_array(f: BinaryIO, code: str, nbytes: int) -> array[int]:
    a = array(code)
    a.frombytes(_read_exact(f, nbytes))
    if sys.byteorder != "little":
        a.byteswap()
    return a


def read(path: str) -> tuple[Table, dict[str, Any], list[RaftEntry]]:
    """Load a snapshot written by `write`."""
    with open(path, "rb") as f:
        return load(f, path)


def raft_meta_of(path: str) -> dict[str, Any]:
    """The Raft metadata (membership, labels) the snapshot at `path` holds, without
    loading its table: a leader checks that a dump names it before sending it."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise SnapshotError(f"{path} is not a kvdir snapshot")
        (hlen,) = struct.unpack("<I", _read_exact(f, 4))
        raft: dict[str, Any] = json.loads(_read_exact(f, hlen)).get("raft", {})
        return raft


def index_of(path: str) -> int:
    """The last log index the snapshot at `path` covers, without loading its table.

    A follower decides with it whether a snapshot the leader sent is older
    than its own dump before it replaces that dump (`DurableSyncObj`).
    """
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise SnapshotError(f"{path} is not a kvdir snapshot")
        (hlen,) = struct.unpack("<I", _read_exact(f, 4))
        header = json.loads(_read_exact(f, hlen))
        f.seek(
            sum(header["array_bytes"])
            + header["slots"]
            + header["keys_bytes"]
            + 4 * sum(header["head_counts"]),
            1,
        )
        last = 0
        for _ in range(header["raft_entries"]):
            (n,) = struct.unpack("<I", _read_exact(f, 4))
            f.seek(n, 1)
            idx, _term = struct.unpack("<QQ", _read_exact(f, 16))
            last = max(last, int(idx))
        return last


def load(f: BinaryIO, name: str = "snapshot") -> tuple[Table, dict[str, Any], list[RaftEntry]]:
    """Load a snapshot from an open file (see `write_to`)."""
    if f.read(len(MAGIC)) != MAGIC:
        raise SnapshotError(f"{name} is not a kvdir snapshot")
    (hlen,) = struct.unpack("<I", _read_exact(f, 4))
    header = json.loads(_read_exact(f, hlen))
    if header.get("format") not in FORMATS_READ:
        raise SnapshotError(f"snapshot format {header.get('format')} is not supported")
    table = Table()
    c = table.col
    cols = c.arrays()
    if len(header.get("array_bytes", ())) != len(cols):
        raise SnapshotError(
            f"snapshot has {len(header.get('array_bytes', ()))} columns, "
            f"this version expects {len(cols)}"
        )
    for col, nbytes in zip(cols, header["array_bytes"], strict=True):
        col.extend(_read_array(f, col.typecode, nbytes))
    nslots = header["slots"]
    lengths = _read_exact(f, nslots)
    blob = _read_exact(f, header["keys_bytes"])
    c.key = _split_keys(lengths, blob)
    heads = [_read_array(f, "I", 4 * n) for n in header["head_counts"]]
    entries: list[RaftEntry] = []
    for _ in range(header["raft_entries"]):
        (n,) = struct.unpack("<I", _read_exact(f, 4))
        cmd = _read_exact(f, n)
        idx, term = struct.unpack("<QQ", _read_exact(f, 16))
        entries.append((cmd, idx, term))
    _restore_meta(table, header, heads)
    return table, header["raft"], entries


def _split_keys(lengths: bytes, blob: bytes) -> list[bytes | None]:
    keys: list[bytes | None] = []
    pos = 0
    for n in lengths:
        if n:
            keys.append(blob[pos : pos + n])
            pos += n
        else:
            keys.append(None)
    return keys


def _restore_meta(table: Table, header: dict[str, Any], heads: list[array[int]]) -> None:
    table.free = header["free"]
    table.entries = header["entries"]
    table.ns_names = list(header["namespaces"])
    table.ns_ids = {name: i for i, name in enumerate(table.ns_names)}
    keys = table.col.key
    table.blocks = [BlockIndex.of(keys, h) for h in heads]
    for idx, rec in enumerate(header["nodes"]):
        if rec is None:
            table.node_by_idx.append(None)
            continue
        node = NodeState(
            rec[0], rec[1], rec[2], tuple(rec[3]), rec[4], rec[5], rec[6], rec[7], rec[8]
        )
        table.node_by_idx.append(node)
        table.nodes[node.node_id] = node
        table.node_idx[node.node_id] = idx
    table.free_node_idx = list(header["free_node_idx"])
    shard_map = header.get("shard_map")  # absent in format 2
    try:
        table.shard_map = None if shard_map is None else ShardMap.from_json(shard_map)
        table.fence = ShardFence.from_json(header.get("shard_fence"))
    except (ShardMapError, ValueError) as e:
        raise SnapshotError(f"snapshot shard map or fence: {e}") from e
    if table.free != NIL and not 0 <= table.free < len(keys):
        raise SnapshotError("snapshot free list is corrupt")


__all__ = [
    "Frozen",
    "Image",
    "SnapshotError",
    "capture",
    "drop",
    "freeze",
    "index_of",
    "load",
    "raft_meta_of",
    "read",
    "restrict",
    "table_of",
    "write",
    "write_to",
]
