"""Shared helpers for the unit tests of the pure directory core.

Everything here reads the table only through its public surface (`apply`,
`lookup`, `records`, `nodes`, `entries`, `block_count`, `expired_nodes`), so
the helpers describe behaviour, not layout.
"""

from __future__ import annotations

import gc
import struct
from pathlib import Path

from kvdir.directory import snapshot
from kvdir.directory.commands import Publish, Published, Registered, RegisterNode, Result, Tier
from kvdir.directory.lookup import PackedRecords
from kvdir.directory.table import Records, Table

NS = "model\x1fbf16\x1f16\x1fnhd\x1f0/1"
"""A namespace key shaped like the ones `validate.namespace_key` builds."""

Row = tuple[int, int, int, int, int]
"""One block's holder record as (address, length, rkey, generation, tier)."""

View = list[tuple[str, int, tuple[Row, ...]]]
"""A lookup answer as plain data: (node id, prefix blocks, records per block)."""


def h(i: int, width: int = 8) -> bytes:
    """Block hash number `i`, `width` bytes big-endian."""
    return i.to_bytes(width, "big")


def chain(n: int, start: int = 0, width: int = 8) -> list[bytes]:
    return [h(i, width) for i in range(start, start + n)]


def register(
    t: Table,
    node: str,
    incarnation: int = 1,
    *,
    lease_ms: int = 1_000,
    now_ms: int = 0,
    host: str = "host",
    endpoint: str = "ep:1",
    transports: tuple[str, ...] = ("tcp",),
) -> Result:
    return t.apply(RegisterNode(node, host, endpoint, transports, incarnation, lease_ms, now_ms))


def must_register(
    t: Table, node: str, incarnation: int = 1, *, lease_ms: int = 1_000, now_ms: int = 0
) -> Registered:
    res = register(t, node, incarnation, lease_ms=lease_ms, now_ms=now_ms)
    assert isinstance(res, Registered), res
    return res


def publish_cmd(
    node: str,
    hashes: list[bytes],
    *,
    incarnation: int = 1,
    ns: str = NS,
    tier: int = Tier.GPU,
    gen: int = 1,
    addr: int = 0x1000,
    length: int = 4096,
    rkey: int = 7,
) -> Publish:
    """A publish whose record for hashes[i] is (addr + i, length, rkey, gen, tier)."""
    n = len(hashes)
    return Publish(
        node,
        incarnation,
        ns,
        int(tier),
        list(hashes),
        [addr + i for i in range(n)],
        [length] * n,
        [rkey] * n,
        [gen] * n,
    )


def publish(
    t: Table,
    node: str,
    hashes: list[bytes],
    *,
    incarnation: int = 1,
    ns: str = NS,
    tier: int = Tier.GPU,
    gen: int = 1,
    addr: int = 0x1000,
    length: int = 4096,
    rkey: int = 7,
) -> Result:
    return t.apply(
        publish_cmd(
            node,
            hashes,
            incarnation=incarnation,
            ns=ns,
            tier=tier,
            gen=gen,
            addr=addr,
            length=length,
            rkey=rkey,
        )
    )


def must_publish(
    t: Table,
    node: str,
    hashes: list[bytes],
    *,
    incarnation: int = 1,
    ns: str = NS,
    tier: int = Tier.GPU,
    gen: int = 1,
    addr: int = 0x1000,
    length: int = 4096,
    rkey: int = 7,
) -> Published:
    res = publish(
        t,
        node,
        hashes,
        incarnation=incarnation,
        ns=ns,
        tier=tier,
        gen=gen,
        addr=addr,
        length=length,
        rkey=rkey,
    )
    assert isinstance(res, Published), res
    return res


def view(
    t: Table, chain_: list[bytes], *, ns: str = NS, max_nodes: int = 64, exclude: str = ""
) -> View:
    """`t.lookup(...)` as plain data, records included; the wire form of each
    match's records (what the Lookup RPC and mirrors send) must say the same."""
    assert not gc.is_tracked(t.col.key), "the key column is walked by the cyclic GC"
    out: View = []
    for m in t.lookup(ns, chain_, max_nodes, exclude):
        r = t.records(m.slots)
        assert t.packed_records(m.slots) == packed(r), f"wire records of {m.node.node_id}"
        rows = tuple(zip(r.addresses, r.lengths, r.rkeys, r.generations, r.tiers, strict=True))
        out.append((m.node.node_id, m.prefix_blocks, rows))
    return out


def packed(r: Records) -> PackedRecords:
    """`r` in the wire form, packed one value at a time (the slow, obvious way)."""
    n = len(r.addresses)
    return PackedRecords(
        struct.pack(f"<{n}Q", *r.addresses),
        struct.pack(f"<{n}I", *r.lengths),
        struct.pack(f"<{n}I", *r.rkeys),
        struct.pack(f"<{n}Q", *r.generations),
        bytes(r.tiers),
    )


def holders(t: Table, chain_: list[bytes], ns: str = NS) -> list[tuple[str, int]]:
    """(node id, prefix blocks) of a lookup."""
    return [(m.node.node_id, m.prefix_blocks) for m in t.lookup(ns, chain_, 64)]


def node_entries_total(t: Table) -> int:
    return sum(n.entries for n in t.nodes.values())


def restored(t: Table, path: Path) -> Table:
    """`t` after snapshot capture, write and read through the file `path`."""
    snapshot.write(snapshot.capture(t), str(path), {}, [])
    table, raft, entries = snapshot.read(str(path))
    assert raft == {}
    assert entries == []
    return table
