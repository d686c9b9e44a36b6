"""Lookup answers as protobuf messages, shared by the Lookup RPCs and mirrors.

A mirror (kvdir/core/mirror.py) answers with the same messages as a replica
because both build them here from the same `Table.lookup` matches.
"""

from __future__ import annotations

from typing import Any

from kvdir.directory.table import Match, Table


def fill(out: Any, table: Table, matches: list[Match], omit_records: bool) -> None:
    """Append NodeMatch messages to `out` (a repeated field); call under the table's lock."""
    for m in matches:
        node = m.node
        nm = out.add(
            node_id=node.node_id,
            prefix_blocks=m.prefix_blocks,
            host=node.host,
            agent_endpoint=node.endpoint,
            transports=node.transports,
        )
        if not omit_records:
            rec = table.packed_records(m.slots)
            nm.addresses, nm.lengths, nm.rkeys = rec.addresses, rec.lengths, rec.rkeys
            nm.generations, nm.tiers = rec.generations, rec.tiers
