"""pysyncobj's TCP transport with the cluster id fence (`membership.hello`), and the
framing of big entries that every transport a replica uses gets (`with_framing`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pysyncobj.transport import TCPTransport

from kvdir.directory.consensus.fixes import ChunkFraming
from kvdir.directory.consensus.membership import hello, split_hello

log = logging.getLogger("kvdir.directory.membership")

_REJECT_LOG_S = 10.0
_REJECTED_MEMO_MAX = 1024
_FRAMED: dict[type, type] = {}


class _FramedSends:
    """Sends every message through `ChunkFraming` (a big entry's chunks labelled right).

    A mixin over whichever transport class the replica runs with (TCP in
    production, the seeded simulator's network in tests), so both send the
    same frames. The owning SyncObj provides `entry_at`.
    """

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803
        self._kvdir_framing = ChunkFraming(syncObj.entry_at)
        super().__init__(syncObj, selfNode, otherNodes)  # type: ignore[call-arg]

    def send(self, node: Any, message: Any) -> bool:
        return bool(super().send(node, self._kvdir_framing.frame(node, message)))  # type: ignore[misc]


def with_framing(transport_class: type) -> type:
    """`transport_class` with `_FramedSends` in front (one class per transport class)."""
    framed = _FRAMED.get(transport_class)
    if framed is None:
        framed = type(f"Framed{transport_class.__name__}", (_FramedSends, transport_class), {})
        _FRAMED[transport_class] = framed
    return framed


class FencedTransport(TCPTransport):  # type: ignore[misc]
    """pysyncobj's TCP transport, refusing peers of another cluster id.

    The owning SyncObj carries the id as ``kvdir_cluster_id``. Only the first
    message of a connection (the announced address) changes; everything after
    it is pysyncobj's own protocol.
    """

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803
        self._kvdir_cluster_id: str = getattr(syncObj, "kvdir_cluster_id", "")
        self._kvdir_rejected: dict[str, float] = {}
        super().__init__(syncObj, selfNode, otherNodes)

    def _sendSelfAddress(self, conn: Any) -> None:  # noqa: N802 (pysyncobj's name)
        if self._selfIsReadonlyNode:
            super()._sendSelfAddress(conn)
        else:
            conn.send(hello(self._selfNode.address, self._kvdir_cluster_id))

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:  # noqa: N802
        exchanging_keys = self._syncObj.encryptor and not conn.sendRandKey
        if isinstance(message, str) and not exchanging_keys:
            address, theirs = split_hello(message)
            if theirs != self._kvdir_cluster_id:
                self._refuse(conn, address, theirs)
                return
            message = address
        super()._onIncomingMessageReceived(conn, message)

    def _refuse(self, conn: Any, address: str, theirs: str) -> None:
        now = time.monotonic()
        if now - self._kvdir_rejected.get(address, -_REJECT_LOG_S) >= _REJECT_LOG_S:
            self._kvdir_rejected[address] = now
            if len(self._kvdir_rejected) > _REJECTED_MEMO_MAX:
                self._kvdir_rejected.clear()
            log.warning(
                "refused a raft peer of another cluster",
                extra={"peer": address, "peer_cluster": theirs, "cluster": self._kvdir_cluster_id},
            )
        conn.disconnect()
        self._unknownConnections.discard(conn)
