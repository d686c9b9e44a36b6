"""Turn gRPC requests into commands, refusing malformed input with a reason.

Every check happens before anything is proposed to Raft, so a bad request
costs one RPC and never a log entry. `BadRequest.reason` is a stable
machine-readable token (sent as trailing metadata `kvdir-reason`); the message
is for people.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvdir.core import wire
from kvdir.core.wire import (
    ENDPOINT_BYTES_MAX,
    HASH_BYTES_MAX,
    HOST_BYTES_MAX,
    NODE_ID_BYTES_MAX,
    TRANSPORT_NAME_BYTES_MAX,
    TRANSPORTS_MAX,
)
from kvdir.directory.commands import Publish, Remove, Tier
from kvdir.directory.limits import LEASE_MS_MAX, LEASE_MS_MIN, RequestLimits
from kvdir.directory.lookup import Chain
from kvdir.v1 import directory_pb2 as pb

_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_TIERS = frozenset(int(t) for t in Tier)


class BadRequest(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def namespace_key(ns: pb.Namespace) -> str:
    """The namespace's key (kvdir.core.wire), a malformed one refused as a BadRequest."""
    try:
        return wire.namespace_key(ns)
    except wire.BadNamespace as e:
        raise BadRequest("bad-namespace", str(e)) from e


def node_id(value: str) -> str:
    if not value:
        raise BadRequest("bad-node-id", "node_id is required")
    if len(value.encode()) > NODE_ID_BYTES_MAX:
        raise BadRequest("bad-node-id", f"node_id is longer than {NODE_ID_BYTES_MAX} bytes")
    return value


def hashes(
    block_hashes: Sequence[bytes], block_ids: Sequence[int], limit: int, what: str
) -> list[bytes]:
    """The block hashes of a request, u64 ids normalised to 8 bytes big-endian."""
    if block_hashes and block_ids:
        raise BadRequest("bad-hashes", f"{what}: give block_hashes or block_ids, not both")
    n = len(block_hashes) or len(block_ids)
    if n > limit:
        raise BadRequest("too-many-blocks", f"{what}: {n} blocks is over the limit of {limit}")
    if block_ids:
        packed = struct.pack(f">{n}Q", *block_ids)
        return [packed[i : i + 8] for i in range(0, 8 * n, 8)]
    out = list(block_hashes)
    widths = set(map(len, out))  # one C-level pass; usually a single width
    if widths and not (min(widths) > 0 and max(widths) <= HASH_BYTES_MAX):
        bad = min(widths) if min(widths) == 0 else max(widths)
        raise BadRequest(
            "bad-hashes", f"{what}: a block hash has {bad} bytes (1..{HASH_BYTES_MAX})"
        )
    return out


def tier(value: int) -> int:
    if value not in _TIERS:
        raise BadRequest("bad-tier", f"tier {value} is not TIER_GPU or TIER_HOST")
    return value


def _column(values: Sequence[int], n: int, name: str, maximum: int) -> list[int]:
    if len(values) != n:
        raise BadRequest("bad-batch", f"{name} has {len(values)} values for {n} blocks")
    out = list(values)
    if n and max(out) > maximum:
        raise BadRequest("bad-batch", f"a value of {name} is over {maximum}")
    return out


def _lengths(
    values: Sequence[int], n: int, addresses: Sequence[int], rkeys: Sequence[int]
) -> list[int]:
    """Block lengths: one per block, each at least a byte (a block of 0 bytes is no block).

    The one exception is an index-only record, address, length and rkey all 0:
    the agent publishes stock engines' caches so (docs/events.md), for routing,
    with no bytes anyone can read. The directory does not know a namespace's
    block size (the agents do, and check every record against their pool's slot
    size before reading), but every block of one namespace is the same size: a
    Publish whose readable lengths differ names at least one length that cannot
    be a block of its namespace.
    """
    out = _column(values, n, "lengths", _U32_MAX)
    readable = [ln for ln, a, r in zip(out, addresses, rkeys, strict=True) if ln or a or r]
    if readable and min(readable) == 0:
        raise BadRequest("bad-length", "a block length is 0 (a block has at least one byte)")
    if readable and min(readable) != max(readable):
        low, high = min(readable), max(readable)
        raise BadRequest(
            "bad-length", f"block lengths differ within one namespace ({low} and {high} bytes)"
        )
    return out


def publish(req: pb.PublishRequest, limits: RequestLimits) -> Publish:
    ns = namespace_key(req.namespace)
    hs = hashes(req.block_hashes, req.block_ids, limits.batch_entries_max, "publish")
    n = len(hs)
    if n == 0:
        raise BadRequest("bad-batch", "publish has no blocks")
    addresses = _column(req.addresses, n, "addresses", _U64_MAX)
    rkeys = _column(req.rkeys, n, "rkeys", _U32_MAX)
    return Publish(
        node_id(req.node_id),
        req.incarnation,
        ns,
        tier(req.tier),
        hs,
        addresses,
        _lengths(req.lengths, n, addresses, rkeys),
        rkeys,
        _column(req.generations, n, "generations", _U64_MAX),
    )


def remove(req: pb.RemoveRequest, limits: RequestLimits) -> Remove:
    ns = namespace_key(req.namespace)
    hs = hashes(req.block_hashes, req.block_ids, limits.batch_entries_max, "remove")
    if not hs:
        raise BadRequest("bad-batch", "remove has no blocks")
    gens, addrs = list(req.generations), list(req.addresses)
    for name, guard in (("generations", gens), ("addresses", addrs)):
        if guard and len(guard) != len(hs):
            raise BadRequest("bad-batch", f"{name} has {len(guard)} values for {len(hs)} blocks")
    return Remove(node_id(req.node_id), req.incarnation, ns, tier(req.tier), hs, gens, addrs)


def _packed_chain(req: pb.LookupRequest, limit: int) -> Chain:
    if req.block_hashes or req.block_ids:
        raise BadRequest("bad-hashes", "lookup: give one of block_hashes, block_ids, packed_hashes")
    w, data = req.hash_width, req.packed_hashes  # each read of a bytes field copies it
    if not 0 < w <= HASH_BYTES_MAX or len(data) % w:
        raise BadRequest(
            "bad-hashes",
            f"lookup: packed_hashes of {len(data)} bytes is not a whole number "
            f"of hash_width {w} (1..{HASH_BYTES_MAX}) hashes",
        )
    n = len(data) // w
    if n > limit:
        raise BadRequest("too-many-blocks", f"lookup: {n} blocks is over the limit of {limit}")
    return Chain(data, w)


def chain(req: pb.LookupRequest, limit: int) -> Chain:
    """A lookup's chain in its cheapest form (packed whenever the widths agree)."""
    if req.hash_width or req.packed_hashes:  # the width first: reading the bytes copies them
        return _packed_chain(req, limit)
    if req.block_ids and not req.block_hashes:
        n = len(req.block_ids)
        if n > limit:
            raise BadRequest("too-many-blocks", f"lookup: {n} blocks is over the limit of {limit}")
        return Chain(struct.pack(f">{n}Q", *req.block_ids), 8)
    items = hashes(req.block_hashes, req.block_ids, limit, "lookup")
    widths = set(map(len, items))
    if len(widths) == 1:
        return Chain(b"".join(items), widths.pop(), items)
    return Chain(b"", 0, items)


def lookup_chain(req: pb.LookupRequest, limits: RequestLimits) -> tuple[str, Chain, int]:
    """(namespace key, chain, max nodes) of a lookup."""
    ns = namespace_key(req.namespace)
    chain_ = chain(req, limits.chain_blocks_max)
    if not len(chain_):
        raise BadRequest("bad-chain", "lookup chain is empty")
    max_nodes = req.max_nodes or limits.lookup_nodes_default
    if max_nodes > limits.lookup_nodes_max:
        raise BadRequest(
            "bad-max-nodes", f"max_nodes {max_nodes} is over the limit of {limits.lookup_nodes_max}"
        )
    return ns, chain_, max_nodes


def registration(req: pb.RegisterNodeRequest, lease_default_ms: int) -> tuple[str, int]:
    """Validate a RegisterNode request; returns (node id, lease ms)."""
    nid = node_id(req.node_id)
    if not req.host or len(req.host.encode()) > HOST_BYTES_MAX:
        raise BadRequest("bad-host", f"host is required and at most {HOST_BYTES_MAX} bytes")
    if len(req.agent_endpoint.encode()) > ENDPOINT_BYTES_MAX:
        raise BadRequest("bad-endpoint", f"agent_endpoint is over {ENDPOINT_BYTES_MAX} bytes")
    if len(req.transports) > TRANSPORTS_MAX or any(
        not t or len(t.encode()) > TRANSPORT_NAME_BYTES_MAX for t in req.transports
    ):
        raise BadRequest(
            "bad-transports",
            f"at most {TRANSPORTS_MAX} transports of 1..{TRANSPORT_NAME_BYTES_MAX} bytes each",
        )
    if req.incarnation == 0:
        raise BadRequest("bad-incarnation", "incarnation must be > 0")
    lease_ms = req.lease_ms or lease_default_ms
    if not LEASE_MS_MIN <= lease_ms <= LEASE_MS_MAX:
        raise BadRequest("bad-lease", f"lease_ms must be in {LEASE_MS_MIN}..{LEASE_MS_MAX}")
    return nid, lease_ms
