"""The gateway's directory source: an in-process mirror, the RPC path as fallback.

With `directory_mirror` on (the default), the gateway keeps a `Mirror` of
the directory fed by one Watch stream (kvdir/core/mirror.py) and answers
every lookup in process, on the event loop, in tens of microseconds: no
batching queue, no round trip, no load on the replicas. While the mirror is
stale (not yet started, or behind by more than `directory_mirror_staleness_ms`)
requests take the batched RPC path (`DirectoryLookups`), which degrades to
least-loaded routing as before when the directory cannot answer.
"""

from __future__ import annotations

from kvdir.core.mirror import Mirror, NotServed
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.core.wire import namespace_key
from kvdir.directory.limits import RequestLimits
from kvdir.directory.lookup import Chain
from kvdir.gateway.lookup import DirectoryLookups
from kvdir.routing.policy import Holder, Prompt
from kvdir.v1 import directory_pb2 as pb

LOOKUP_NODES = RequestLimits().lookup_nodes_default
"""Holders asked per lookup: what a replica answers a request naming none."""


class MirroredLookups:
    def __init__(
        self,
        rpc: DirectoryLookups,
        mirror: Mirror | ShardedMirror,
        sync: MirrorSync | ShardedMirrorSync,
    ) -> None:
        self.rpc = rpc
        self.mirror = mirror
        self.sync = sync
        self.served = 0
        self.fallbacks = 0
        self._keys: dict[bytes, str] = {}

    @property
    def up(self) -> bool:
        return self.rpc.up

    @property
    def reason(self) -> str:
        return self.rpc.reason

    def start(self) -> None:
        self.rpc.start()
        self.sync.start()

    async def stop(self) -> None:
        self.sync.stop()
        await self.rpc.stop()

    def _key(self, ns: pb.Namespace) -> str:
        raw = ns.SerializeToString()
        key = self._keys.get(raw)
        if key is None:
            key = self._keys[raw] = namespace_key(ns)
        return key

    async def prompt(self, ns: pb.Namespace, chain: list[bytes]) -> Prompt | None:
        """Who holds `chain`'s prefix: from the mirror, else over gRPC."""
        try:
            found = self.mirror.holders(self._key(ns), Chain.of(chain), LOOKUP_NODES)
        except NotServed:
            self.fallbacks += 1
            return await self.rpc.prompt(ns, chain)
        self.served += 1
        return Prompt(
            len(chain),
            {nid: Holder(nid, blocks, host, transports) for nid, blocks, host, transports in found},
        )
