"""Load tickets: the engine's lookup answer, carried to its fetch (one lookup per load).

The agent's Lookup (agent/service.py) finds the best holders of a chain with
their records; `Tickets.issue` packs them into a LoadTicket (agent.proto),
signed with a key of this agent process, and the engine hands the bytes back
in its Fetch. `Tickets.check` refuses what this process did not issue (a MAC
mismatch: forged, corrupted, or issued before a restart) and anything over the
bounds of agent/limits.py, with BadTicket saying why (the service answers
INVALID_ARGUMENT, the connector recomputes those blocks).

A checked ticket is still only a hint. Its records may be stale by the time
the fetch reads (a slot evicted and reused, a holder gone): the fetch path
validates every block against the holder's slot header after the bytes land
(agent/fetcher.py), so staleness costs a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from kvdir.agent.holders import Holder
from kvdir.agent.limits import (
    CHAIN_BLOCKS_MAX,
    TICKET_BYTES_MAX,
    TICKET_HOLDERS_MAX,
    TICKET_MAC_BYTES,
)
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb

KEY_BYTES = 32
_COLUMN_BYTES = (("addresses", 8), ("lengths", 4), ("rkeys", 4), ("generations", 8))


class BadTicket(ValueError):
    """A ticket this agent cannot use as given (the message says why)."""


class StaleTicket(Exception):
    """A ticket of this agent for another pool epoch: its answer is a miss."""


class Tickets:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(KEY_BYTES)

    def _mac(self, body: bytes) -> bytes:
        return hashlib.blake2b(body, key=self._key, digest_size=TICKET_MAC_BYTES).digest()

    def issue(self, ns_key: str, epoch: int, holders: Sequence[Holder]) -> bytes:
        """The signed ticket of these holders (best first; at most TICKET_HOLDERS_MAX)."""
        assert len(holders) <= TICKET_HOLDERS_MAX, "the caller trims holders to the bound"
        body = apb.LoadTicket(
            namespace_key=ns_key, epoch=epoch, holders=[h.message() for h in holders]
        ).SerializeToString()
        return body + self._mac(body)

    def check(self, data: bytes, ns_key: str, epoch: int) -> list[Holder]:
        """The holders of a ticket this agent issued for `ns_key` (BadTicket otherwise;
        StaleTicket when it was issued for another epoch of the pool)."""
        if len(data) > TICKET_BYTES_MAX:
            raise BadTicket(f"load ticket of {len(data)} bytes is over {TICKET_BYTES_MAX}")
        body, mac = data[:-TICKET_MAC_BYTES], data[-TICKET_MAC_BYTES:]
        if len(data) <= TICKET_MAC_BYTES or not hmac.compare_digest(mac, self._mac(body)):
            raise BadTicket(
                "load ticket not issued by this agent (corrupted, forged, or from before a restart)"
            )
        try:
            t = apb.LoadTicket.FromString(body)
        except DecodeError as e:
            raise BadTicket(f"load ticket does not parse: {e}") from e
        if t.namespace_key != ns_key:
            raise BadTicket("load ticket is for another namespace than the fetch")
        if t.epoch != epoch:
            raise StaleTicket(f"load ticket of pool epoch {t.epoch:#x}, the pool is {epoch:#x}")
        if len(t.holders) > TICKET_HOLDERS_MAX:
            raise BadTicket(
                f"load ticket names {len(t.holders)} holders (at most {TICKET_HOLDERS_MAX})"
            )
        for m in t.holders:
            _check_holder(m)
        return [Holder.of(m) for m in t.holders]


def _check_holder(m: pb.NodeMatch) -> None:
    n = m.prefix_blocks
    if not 0 < n <= CHAIN_BLOCKS_MAX:
        raise BadTicket(f"load ticket holder {m.node_id!r} has a prefix of {n} blocks")
    if not m.agent_endpoint:
        raise BadTicket(f"load ticket holder {m.node_id!r} has no endpoint")
    for name, width in _COLUMN_BYTES:
        if len(getattr(m, name)) != n * width:
            raise BadTicket(f"load ticket holder {m.node_id!r}: {name} do not cover {n} blocks")
    if len(m.tiers) not in (0, n):
        raise BadTicket(f"load ticket holder {m.node_id!r}: tiers do not cover {n} blocks")
