"""Client of kvdir.v1.PrefixDirectory for agents, schedulers, the CLI and tests.

It knows every replica's gRPC address, follows the leader hint servers send
with UNAVAILABLE, and retries what is safe to retry within one deadline and
a bounded number of attempts:

- UNAVAILABLE / RESOURCE_EXHAUSTED (not applied): retried on the hinted leader
  or the next replica.
- unknown outcome: retried too, because every directory write is idempotent
  (publishes carry generations, removes are guarded, registration is keyed by
  incarnation) and a replica appends a write only while it leads the term it
  took it in, so an earlier attempt is in the log before the retry or never
  commits: it cannot land after the client's next write.
  `retry_unknown=False` surfaces `OutcomeUnknown` instead.
- Only the leader takes writes: a follower refuses with the leader's address,
  which the client adds to its addresses (up to `ADDRESSES_MAX`) when it was
  given another list (a single address in front of the replicas).
- INVALID_ARGUMENT: never retried; raised as `DirectoryError` with its reason.
- UNAUTHENTICATED / PERMISSION_DENIED (secure mode): never retried.

Exception tree::

    DirectoryError            (code, reason, message)
    +-- Unavailable           no replica could take the request in time
    +-- OutcomeUnknown        a write may or may not have committed
"""

from __future__ import annotations

import random
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

ATTEMPTS_MAX = 64
ADDRESSES_MAX = 16
"""Addresses a client holds: those it was given and the leaders it was told of."""
BACKOFF_S_MIN = 0.01
BACKOFF_S_MAX = 0.05  # an election takes ~0.2-0.3 s: poll it finely
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# CANCELLED reaches this client only from the server side (this client never
# cancels its own calls): a replica stopping cancels the calls its grace period
# did not finish, so a write it was carrying may or may not have committed.
_UNKNOWN = {grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# A read changes nothing, so its outcome is never unknown: a read that runs out of
# time is Unavailable, and says why the replicas refused it before the deadline
# cut the last attempt (CI at aa81aa9: a catching-up replica's refusal, retried
# until the last attempt got a few ms and timed out, was reported as
# "OutcomeUnknown: Deadline Exceeded").
_READS = frozenset({"Lookup", "LookupBatch", "ListNodes", "ClusterStatus", "GetShardMap"})


def _metadata(e: grpc.RpcError) -> dict[str, str]:
    """Trailing metadata of a failed call as a dict (values as text)."""
    out: dict[str, str] = {}
    for item in e.trailing_metadata() or ():
        key, value = item.key, item.value  # _Metadatum is a namedtuple at runtime
        out[key] = value.decode() if isinstance(value, bytes) else str(value)
    return out


class DirectoryError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata = metadata or {}
        """The refusal's trailing metadata (a wrong_shard refusal's map version)."""
        self.committed: tuple[int, ...] = ()
        """A sharded write: positions of the batch whose parts did commit anyway."""


class Unavailable(DirectoryError):
    pass


class OutcomeUnknown(DirectoryError):
    pass


@dataclass(frozen=True, slots=True)
class HolderRecords:
    """Decoded holder records of one NodeMatch (one element per prefix block)."""

    addresses: list[int]
    lengths: list[int]
    rkeys: list[int]
    generations: list[int]
    tiers: list[int]


def _column(code: str, data: bytes, n: int) -> list[int]:
    col = array(code)
    col.frombytes(data)
    if sys.byteorder != "little":
        col.byteswap()
    if len(col) != n:
        raise ValueError(f"record column has {len(col)} values for {n} blocks")
    return col.tolist()


def records(match: pb.NodeMatch) -> HolderRecords:
    """The holder records of a lookup match (empty when records were omitted)."""
    n = match.prefix_blocks if match.addresses else 0
    return HolderRecords(
        _column("Q", match.addresses, n),
        _column("I", match.lengths, n),
        _column("I", match.rkeys, n),
        _column("Q", match.generations, n),
        list(match.tiers),
    )


def lookup_request(
    ns: pb.Namespace,
    chain: Sequence[bytes],
    max_nodes: int = 0,
    exclude_node: str = "",
    omit_records: bool = False,
) -> pb.LookupRequest:
    """A LookupRequest in the cheapest wire form (packed when all hashes share a width)."""
    req = pb.LookupRequest(
        namespace=ns, max_nodes=max_nodes, exclude_node=exclude_node, omit_records=omit_records
    )
    widths = set(map(len, chain))
    if len(widths) == 1:
        req.packed_hashes = b"".join(chain)
        req.hash_width = widths.pop()
    else:
        req.block_hashes.extend(chain)
    return req


def namespace(
    model: str,
    block_tokens: int,
    dtype: str = "",
    layout: str = "",
    tp_rank: int = 0,
    tp_size: int = 0,
) -> pb.Namespace:
    return pb.Namespace(
        model=model,
        dtype=dtype,
        block_tokens=block_tokens,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class DirectoryRequests:
    """What both clients (one group's, the sharded one) build the same way: each
    write's request, handed to the client's `_write` (one group's: its retrying
    `call`; the sharded one: split by group or sent to every group, answers
    merged), and a lookup by chain, handed to its `_lookup`."""

    def _write(self, method: str, request: Any) -> Any:
        raise NotImplementedError

    def _lookup(
        self, req: pb.LookupRequest, chain: Sequence[bytes], address: str | None
    ) -> pb.LookupResponse:
        raise NotImplementedError

    def lookup(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        max_nodes: int = 0,
        exclude_node: str = "",
        linearizable: bool = False,
        address: str | None = None,
        omit_records: bool = False,
    ) -> pb.LookupResponse:
        req = lookup_request(ns, chain, max_nodes, exclude_node, omit_records)
        req.linearizable = linearizable
        return self._lookup(req, chain, address)

    def register_node(
        self,
        node_id: str,
        host: str,
        incarnation: int,
        endpoint: str = "",
        transports: Sequence[str] = (),
        lease_ms: int = 0,
    ) -> pb.RegisterNodeResponse:
        req = pb.RegisterNodeRequest(
            node_id=node_id,
            host=host,
            agent_endpoint=endpoint,
            transports=transports,
            incarnation=incarnation,
            lease_ms=lease_ms,
        )
        resp: pb.RegisterNodeResponse = self._write("RegisterNode", req)
        return resp

    def heartbeat(self, node_id: str, incarnation: int) -> pb.HeartbeatResponse:
        resp: pb.HeartbeatResponse = self._write(
            "Heartbeat", pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
        )
        return resp

    def publish(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        addresses: Sequence[int],
        lengths: Sequence[int],
        rkeys: Sequence[int],
        generations: Sequence[int],
    ) -> pb.PublishResponse:
        req = pb.PublishRequest(
            node_id=node_id,
            incarnation=incarnation,
            namespace=ns,
            tier=cast("pb.Tier.ValueType", tier),
            block_hashes=hashes,
            addresses=addresses,
            lengths=lengths,
            rkeys=rkeys,
            generations=generations,
        )
        resp: pb.PublishResponse = self._write("Publish", req)
        return resp

    def remove(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace,
        tier: int,
        hashes: Sequence[bytes],
        generations: Sequence[int] = (),
        addresses: Sequence[int] = (),
    ) -> pb.RemoveResponse:
        req = pb.RemoveRequest(
            node_id=node_id,
            incarnation=incarnation,
            namespace=ns,
            tier=cast("pb.Tier.ValueType", tier),
            block_hashes=hashes,
            generations=generations,
            addresses=addresses,
        )
        resp: pb.RemoveResponse = self._write("Remove", req)
        return resp

    def clear_node(
        self,
        node_id: str,
        incarnation: int,
        ns: pb.Namespace | None = None,
        deregister: bool = False,
    ) -> pb.ClearNodeResponse:
        req = pb.ClearNodeRequest(node_id=node_id, incarnation=incarnation, deregister=deregister)
        if ns is not None:
            req.namespace.CopyFrom(ns)
        resp: pb.ClearNodeResponse = self._write("ClearNode", req)
        return resp


class DirectoryClient(DirectoryRequests):
    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float = 5.0,
        retry_unknown: bool = True,
        rng: random.Random | None = None,
        security: ClientSecurity = PLAIN,
    ) -> None:
        if not addresses:
            raise ValueError("at least one directory address is required")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.retry_unknown = retry_unknown
        self._rng = rng or random.Random()
        opts = [
            ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
            ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
        ]
        self.security = security
        self._options = opts
        self._adding = threading.Lock()
        self._channels = {a: security.channel(a, opts) for a in self.addresses}
        self._stubs = {a: pb_grpc.PrefixDirectoryStub(c) for a, c in self._channels.items()}
        self._preferred = 0
        self.retries = 0

    def close(self) -> None:
        for c in self._channels.values():
            c.close()

    def __enter__(self) -> DirectoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stub(self, address: str) -> pb_grpc.PrefixDirectoryStub:
        return self._stubs[address]

    def preferred(self) -> str:
        """The replica the next call goes to first (the last leader heard of)."""
        return self.addresses[self._preferred]

    def _next_address(self, hint: str) -> None:
        if hint and hint not in self._stubs and len(self.addresses) < ADDRESSES_MAX:
            self._add_address(hint)
        if hint and hint in self._stubs:
            self._preferred = self.addresses.index(hint)
        else:
            self._preferred = (self._preferred + 1) % len(self.addresses)

    def _add_address(self, address: str) -> None:
        """A leader that was not in the given list (a refusal named it)."""
        with self._adding:  # calls on several threads may hear of it at once
            if address in self._stubs or len(self.addresses) >= ADDRESSES_MAX:
                return
            channel = self.security.channel(address, self._options)
            self._channels[address] = channel
            self._stubs[address] = pb_grpc.PrefixDirectoryStub(channel)
            self.addresses.append(address)

    def call(
        self,
        method: str,
        request: Any,
        timeout_s: float | None = None,
        address: str | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> Any:
        """Call `method` with retries (see the module docstring) within one deadline.

        `metadata` goes with every attempt (a sharded client's map version)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        last: grpc.RpcError | None = None
        refused: grpc.RpcError | None = None  # the last answer that was a refusal
        for attempt in range(ATTEMPTS_MAX):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            target = address or self.addresses[self._preferred]
            try:
                return getattr(self._stubs[target], method)(
                    request, timeout=remaining, metadata=metadata
                )
            except grpc.RpcError as e:
                last = e
                code = e.code()
                md = _metadata(e)
                unknown = md.get("kvdir-outcome") == "unknown" or code in _UNKNOWN
                if code == grpc.StatusCode.INVALID_ARGUMENT or code not in (_RETRYABLE | _UNKNOWN):
                    raise DirectoryError(
                        code, e.details() or code.name, str(md.get("kvdir-reason", "")), md
                    ) from e
                if code in _RETRYABLE:
                    refused = e
                if unknown and not self.retry_unknown and method not in _READS:
                    raise OutcomeUnknown(code, e.details() or code.name) from e
                if address is None:
                    self._next_address(str(md.get("kvdir-leader", "")))
            self.retries += 1
            pause = min(BACKOFF_S_MAX, BACKOFF_S_MIN * (2**attempt))
            left = max(0.0, deadline - time.monotonic())
            time.sleep(min(pause * (0.5 + self._rng.random()), left))
        if method in _READS and refused is not None:
            last = refused
        detail = last.details() if last is not None else "deadline passed"
        code = last.code() if last is not None else grpc.StatusCode.DEADLINE_EXCEEDED
        cls = OutcomeUnknown if code in _UNKNOWN and method not in _READS else Unavailable
        raise cls(code, f"directory unavailable after retries: {detail}")

    # An alias, not a method calling `call`: no hop on the write path (a subclass
    # overriding `call` must alias it again).
    _write = call

    # -------------------------------------------------------------- reads

    def _lookup(
        self, req: pb.LookupRequest, chain: Sequence[bytes], address: str | None
    ) -> pb.LookupResponse:
        resp: pb.LookupResponse = self.call("Lookup", req, address=address)
        return resp

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        """The Lookup RPC for a built request (`lookup_request`), with retries."""
        resp: pb.LookupResponse = self.call("Lookup", req)
        return resp

    def lookup_batch(
        self,
        lookups: Sequence[pb.LookupRequest],
        linearizable: bool = False,
        address: str | None = None,
    ) -> pb.LookupBatchResponse:
        req = pb.LookupBatchRequest(lookups=lookups, linearizable=linearizable)
        resp: pb.LookupBatchResponse = self.call("LookupBatch", req, address=address)
        return resp

    def list_nodes(self, address: str | None = None) -> pb.ListNodesResponse:
        resp: pb.ListNodesResponse = self.call("ListNodes", pb.ListNodesRequest(), address=address)
        return resp

    def status(self, address: str) -> pb.ClusterStatusResponse:
        """One replica's own view (no failover: the caller asked for that replica)."""
        resp: pb.ClusterStatusResponse = self.call(
            "ClusterStatus", pb.ClusterStatusRequest(), address=address
        )
        return resp
