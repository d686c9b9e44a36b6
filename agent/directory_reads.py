"""The agent's directory reads: an in-process mirror, the RPC path as fallback.

Two users read the directory through the agent: the fetch path (who holds
this chain, with records, before a pull) and the engine's `Lookup` (which
peers hold more than we do; the vLLM connector's scheduler side asks it for
every waiting request). With `directory_mirror` on (the default) both read a
`Mirror` kept fed by one Watch stream (kvdir/core/mirror.py,
kvdir/core/mirror_sync.py) through `MirroredDirectory`: in process while the
mirror is fresh, over gRPC while it is stale (before its first snapshot,
behind by more than `directory_mirror_staleness_ms`, or cut off from every
replica). The stream is filtered to the namespaces of the agent's pools: the
only ones either user asks about.

Why a stale answer is safe here: it can only name a holder that no longer
has the block (or miss one that has it since). The fetch path validates
every block it reads against the holder's slot header (STORED, the hash,
the generation the directory published) after the data, so such an answer
ends the valid prefix early: a miss, never wrong KV (agent/fetcher.py).
`Lookup` only reports peers; what the engine then asks to fetch goes through
that same validation.

Both read `holders`: typed `Holder` values. From a fresh mirror they come
straight off its table (the records' packed columns), or off a sharded
mirror's typed merge (`ShardedMirror.merged`): no LookupRequest or
LookupResponse built and parsed inside the agent; else off a lookup's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvdir.agent.config import AgentConfig
from kvdir.agent.holders import Holder
from kvdir.core.client import DirectoryError
from kvdir.core.mirror import ChainLookups, Lag, Mirror, MirroredDirectory, NotServed
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.security import ClientSecurity
from kvdir.core.sharded_client import AnyDirectoryClient, ShardedDirectoryClient
from kvdir.core.sharded_mirror import Merged, ShardedMirror, ShardedMirrorSync
from kvdir.directory.lookup import Chain
from kvdir.directory.table import Match, Table
from kvdir.directory.validate import BadRequest, namespace_key
from kvdir.v1 import directory_pb2 as pb


class DirectoryReads(Protocol):
    """The one read the agent makes: `DirectoryClient.lookup`'s local read."""

    def lookup(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        max_nodes: int = 0,
        exclude_node: str = "",
        *,
        omit_records: bool = False,
    ) -> pb.LookupResponse: ...


class MirrorReads(ChainLookups):
    """`MirroredDirectory` with its stream, and counts of who answered."""

    def __init__(
        self,
        client: AnyDirectoryClient,
        mirror: Mirror | ShardedMirror,
        sync: MirrorSync | ShardedMirrorSync,
    ) -> None:
        self.mirror = mirror
        self.sync = sync
        self._reads = MirroredDirectory(mirror, client)
        self.lookups = 0

    @property
    def fallbacks(self) -> int:
        """Lookups the RPC path answered (or failed) because the mirror was stale."""
        return self._reads.fallbacks

    @property
    def served(self) -> int:
        """Lookups the mirror answered in process."""
        return self.lookups - self._reads.fallbacks

    def lag(self) -> Lag:
        return self.mirror.lag()

    def start(self) -> None:
        self.sync.start()

    def stop(self) -> None:
        self.sync.stop()

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        """As `DirectoryClient.lookup_message` (local read); `read.replica_id` is
        "mirror:<replica>" when the mirror answered."""
        self.lookups += 1  # counts only: a lost update under threads skews a metric
        return self._reads.lookup_message(req)

    def holders(
        self, ns: pb.Namespace, chain: Sequence[bytes], max_nodes: int, exclude_node: str = ""
    ) -> list[Holder]:
        """`lookup` with records, typed: off a fresh mirror's table when it holds the
        namespace (as `Mirror.lookup_message` decides), else through `lookup`."""
        m = self.mirror
        if isinstance(m, Mirror) and chain:
            key = namespace_key(ns)
            if m.lag().fresh and (m.namespaces is None or key in m.namespaces):
                self.lookups += 1
                with m.lock:
                    table = m.table
                    found = table.lookup(key, Chain.of(chain), max_nodes, exclude_node)
                    return [_holder(table, x) for x in found]
        if isinstance(m, ShardedMirror) and chain:
            try:
                merged = m.merged(namespace_key(ns), Chain.of(chain), max_nodes, exclude_node)
            except (NotServed, BadRequest, DirectoryError):
                pass  # asked again through `lookup`: the replicas, or the request's error
            else:
                self.lookups += 1
                return [_merged_holder(x) for x in merged]
        return [Holder.of(x) for x in self.lookup(ns, chain, max_nodes, exclude_node).matches]


def _holder(table: Table, m: Match) -> Holder:
    """One table match as a Holder (under the table's lock)."""
    node, rec = m.node, table.packed_records(m.slots)
    return Holder(
        node.node_id, m.prefix_blocks, node.host, node.endpoint, tuple(node.transports),
        rec.addresses, rec.lengths, rec.rkeys, rec.generations, rec.tiers,
    )  # fmt: skip


def _merged_holder(m: Merged) -> Holder:
    """One sharded mirror holder as a Holder (records: the merge's own bytes)."""
    node, rec = m.node, m.records
    assert rec is not None, "asked with records"
    return Holder(
        node.node_id, m.prefix_blocks, node.host, node.endpoint, tuple(node.transports),
        rec.addresses, rec.lengths, rec.rkeys, rec.generations, rec.tiers,
    )  # fmt: skip


def read_holders(
    reads: DirectoryReads,
    ns: pb.Namespace,
    chain: Sequence[bytes],
    max_nodes: int,
    exclude_node: str = "",
) -> list[Holder]:
    """Who holds `chain` (with records), best first: typed off the agent's mirror when
    it has one, else from a replica's answer."""
    if isinstance(reads, MirrorReads):
        return reads.holders(ns, chain, max_nodes, exclude_node)
    resp = reads.lookup(ns, chain, max_nodes, exclude_node)
    return [Holder.of(x) for x in resp.matches]


def mirror_reads(
    cfg: AgentConfig, client: AnyDirectoryClient, security: ClientSecurity
) -> MirrorReads | None:
    """The agent's mirror (not started), or None when `directory_mirror` is off.

    With a shard home: a `ShardedMirror` of every group of the home's map, one
    stream per group."""
    if not cfg.directory_mirror:
        return None
    namespaces = [p.namespace() for p in cfg.pools]
    staleness_s = cfg.directory_mirror_staleness_ms / 1000
    if isinstance(client, ShardedDirectoryClient):
        sharded = ShardedMirror(client.shard_map, staleness_s, namespaces)
        sync = ShardedMirrorSync(sharded, security, follow=client.refresh_map)
        return MirrorReads(client, sharded, sync)
    mirror = Mirror(max_staleness_s=staleness_s, namespaces=namespaces)
    return MirrorReads(client, mirror, MirrorSync(mirror, cfg.directory, security))
