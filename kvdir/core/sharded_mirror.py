"""An in-process mirror of a sharded directory: one `Mirror` per group, lookups merged.

`ShardedMirror` has `Mirror`'s read API (the same `LookupResponse` messages,
`holders`, `prefix_lengths`, `lag`). Each group's Watch feeds that group's
own `Mirror` (its own `Table`: the group's committed table, exactly as an
unsharded mirror keeps it, snapshots and resyncs included); a lookup routes
the chain by the mirror's map, asks each group's table for the subsequence
the group owns, and merges the answers as the sharded client merges the
replicas' (`shard_merge.merge_lookup`; tests/unit/test_shard_plan.py checks
the two agree). A chain owned by one group is that group's answer as is.

Why not one union table (the first design): the table's lookup follows runs
of consecutive slots, one comparison per run; a group's part of a chain is
consecutive in its table, but in a union the groups' parts interleave every
block or two, and the lookup falls back to a probe per block. Measured on
this host (loaded) for a 500-block chain: 39 us with 1 group, 4.4 ms with 2
and 5.1 ms with 4 groups in a union; per-group tables keep every part on
the fast path. Per-group tables also make a group's snapshot a swap of its
table, keep one group's node-wide command (a ClearNode, an expiry) from
touching another group's entries, and give digests comparable with each
group's replicas.

Ownership filter: only group g's table is asked about the blocks g owns under
the mirror's map, so an entry a group holds for a key it does not own (a
shard moved away, later) is never read.

Routing a block costs a blake2b of its hash; the groups of recently seen
hashes are remembered (`shard_route.Router`). Routing a chain, cutting out
each group's part and its fingerprints still cost numpy calls by the dozen
per lookup, and depend only on the chain and the map, so they are kept per
chain (`shard_plan.Plans`): a chain asked about again (a waiting request at
every scheduler step) goes straight to the tables. What a lookup then costs
is per group (its table's lookup of its part, its records' columns) plus three
takes to interleave a holder's records. A 500-block chain, one holder, in
process on the 2-core host (load 2.3-2.7 from other work, before and after in
turn, p50 of 1 s rounds): 2 groups 248-273 -> 70-85 us, 4 groups 325-349 ->
92-129 us. A chain not seen before still costs its routing and its plan
(memo probes, split, parts: ~170 us more at 4 groups).

The answer is built as typed values (`merged`: `Merged` holders with their
records as packed columns); `lookup_message` makes the message of them, and
in-process readers that want no message (the agent's holders, routers'
prefix lengths) take them as they are.

Freshness is per group: when some groups are stale (silent or behind for more
than `max_staleness_s`, or not started) their blocks count as absent (a
prefix ends at the chain's first block of a stale group: a miss, not an
error); when every group owning a block of the chain is stale the mirror
raises `NotServed` and callers ask the replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvdir.core.client import DirectoryError, lookup_request
from kvdir.core.mirror import (
    MAX_STALENESS_S_DEFAULT,
    ChainLookups,
    Lag,
    Mirror,
    NotServed,
    check_batch,
    parse_lookup,
)
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.shard_map import ShardMap
from kvdir.core.shard_plan import Plan, Plans
from kvdir.core.shard_route import Router
from kvdir.core.wire import HASH_BYTES_MAX, namespace_of
from kvdir.directory import validate
from kvdir.directory.limits import RequestLimits
from kvdir.directory.lookup import Chain, PackedRecords, RecordColumns
from kvdir.directory.table import NodeState
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.mirror")

MAP_FOLLOW_S = 1.0
"""How often a sharded mirror asks for a newer shard map (the replicas' own bound)."""


@dataclass(frozen=True, slots=True)
class GroupLag:
    group_id: str
    lag: Lag
    error: str
    source: str


@dataclass(frozen=True, slots=True)
class Merged:
    """One holder's prefix of a chain over every group (`ShardedMirror.merged`)."""

    node: NodeState
    prefix_blocks: int
    records: PackedRecords | None
    """The prefix's records in chain order; None when omitted."""


class ShardedMirror(ChainLookups):
    def __init__(
        self,
        shard_map: ShardMap,
        max_staleness_s: float = MAX_STALENESS_S_DEFAULT,
        namespaces: Iterable[pb.Namespace] = (),
        clock: Callable[[], float] = time.monotonic,
        limits: RequestLimits | None = None,
    ) -> None:
        self.map = shard_map
        self.max_staleness_s = max_staleness_s
        self.watched = list(namespaces)
        self.namespaces = frozenset(validate.namespace_key(ns) for ns in self.watched) or None
        self.limits = limits or RequestLimits()
        self.mirrors = {
            g.group_id: Mirror(max_staleness_s, self.watched, clock, self.limits)
            for g in shard_map.groups
        }
        """Each group's own mirror (what its `MirrorSync` feeds)."""
        self._plans = Plans(Router(shard_map))
        """Chains' routing by this map (swapped whole with the map)."""

    # ------------------------------------------------------------- routing

    def set_map(self, shard_map: ShardMap) -> bool:
        """Route by a newer map (a split or a move committed in g0). Only the routing
        changes: each group's table keeps following its group, and a moved shard is
        read from its new owner from now on, whose table holds it once the move's
        import is done (the map names the new owner only after that). A map that
        adds or removes a group is refused (False): a mirror's streams are fixed,
        restart it. True otherwise (an older or the same map changes nothing)."""
        if shard_map.version <= self.map.version:
            return True  # not newer: nothing to change
        if {g.group_id for g in shard_map.groups} != set(self.mirrors):
            return False
        self.map = shard_map
        self._plans = Plans(Router(shard_map))  # swapped whole: a lookup uses one or the other
        return True

    # ------------------------------------------------------------- staleness

    @property
    def applied_index(self) -> int:
        """Every group's applied index summed: it only grows (a progress count), but
        is no one log's index (compare a group's with `mirrors[g].applied_index`)."""
        return sum(m.applied_index for m in self.mirrors.values())

    @property
    def snapshots(self) -> int:
        """Snapshots loaded, every group's together."""
        return sum(m.snapshots for m in self.mirrors.values())

    def group_lags(self) -> list[GroupLag]:
        return [GroupLag(g, m.lag(), m.error, m.source) for g, m in self.mirrors.items()]

    def lag(self) -> Lag:
        """Every group's lag together: indexes and entries summed (a progress count,
        no one log's index), the worst times; fresh only when every group is."""
        lags = [m.lag() for m in self.mirrors.values()]
        return Lag(
            sum(x.applied_index for x in lags),
            sum(x.commit_index for x in lags),
            sum(x.entries for x in lags),
            max(x.ms for x in lags),
            max(x.silent_ms for x in lags),
            all(x.fresh for x in lags),
        )

    def fresh(self) -> bool:
        return self.lag().fresh

    # ----------------------------------------------------------------- reads

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        """As `Mirror.lookup_message`: the merged answer of the groups' tables."""
        if len(self.mirrors) == 1:
            # One group owns every shard: its answer as is, with no routing (which
            # cost more than the lookup itself) and no request parsed twice.
            return next(iter(self.mirrors.values())).lookup_message(req)
        if req.linearizable:
            raise NotServed("linearizable", "a mirror serves local reads only")
        ns, chain, max_nodes = parse_lookup(req, self.limits)
        if self.namespaces is not None and ns not in self.namespaces:
            raise NotServed("namespace-not-mirrored", "this mirror does not hold that namespace")
        plan = self._plans.plan(chain)
        fresh = self._fresh(plan)
        if len(plan.parts) == 1:
            return self.mirrors[plan.parts[0].group_id].lookup_message(req)
        found, read = self._merged(ns, plan, fresh, max_nodes, req.exclude_node, req.omit_records)
        resp = pb.LookupResponse()
        add = resp.matches.add
        for x in found:
            node, r = x.node, x.records
            if r is None:
                add(
                    node_id=node.node_id, prefix_blocks=x.prefix_blocks, host=node.host,
                    agent_endpoint=node.endpoint, transports=node.transports,
                )  # fmt: skip
            else:  # one call with every field: a field set apart costs about as much
                add(
                    node_id=node.node_id, prefix_blocks=x.prefix_blocks, host=node.host,
                    agent_endpoint=node.endpoint, transports=node.transports,
                    addresses=r.addresses, lengths=r.lengths, rkeys=r.rkeys,
                    generations=r.generations, tiers=r.tiers,
                )  # fmt: skip
        if read is not None:
            resp.read.applied_index, resp.read.commit_index = read
        resp.read.replica_id = "mirror:shards"
        return resp

    def merged(
        self,
        ns_key: str,
        chain: Chain,
        max_nodes: int,
        exclude_node: str = "",
        omit_records: bool = False,
    ) -> list[Merged]:
        """`lookup_message`'s matches as typed values, with no message built: best
        first, records in chain order unless omitted. `ns_key` is
        kvdir.core.wire.namespace_key's; raises as `lookup_message` does (NotServed,
        DirectoryError for a chain or max_nodes a replica would refuse)."""
        lim = self.limits
        if not (
            chain.packed
            and 0 < len(chain) <= lim.chain_blocks_max
            and chain.width <= HASH_BYTES_MAX
            and 0 <= max_nodes <= lim.lookup_nodes_max
        ):
            # Anything a replica might refuse or read otherwise: checked as a request.
            req = lookup_request(namespace_of(ns_key), chain.items(), max_nodes, exclude_node)
            _, chain, max_nodes = parse_lookup(req, lim)
        max_nodes = max_nodes or lim.lookup_nodes_default
        if self.namespaces is not None and ns_key not in self.namespaces:
            raise NotServed("namespace-not-mirrored", "this mirror does not hold that namespace")
        plan = self._plans.plan(chain)
        fresh = self._fresh(plan)
        return self._merged(ns_key, plan, fresh, max_nodes, exclude_node, omit_records)[0]

    def _fresh(self, plan: Plan) -> list[bool]:
        """Whether each part's group is fresh; NotServed when none is."""
        fresh = [self.mirrors[p.group_id].fresh() for p in plan.parts]
        if not any(fresh):
            raise NotServed("stale", "every group of this chain is stale; ask the replicas")
        return fresh

    def _merged(
        self,
        ns: str,
        plan: Plan,
        fresh: list[bool],
        max_nodes: int,
        exclude_node: str,
        omit_records: bool,
    ) -> tuple[list[Merged], tuple[int, int] | None]:
        """Each fresh group's table asked for its part of the chain, the answers
        merged straight from the tables' matches: no request or answer message per
        group (they cost 4-5x the lookups at 4 groups). Also the lead group's read
        indexes (None: it is stale), which the answer reflects.

        The merge is `shard_merge.prefix_bounds`' (tests/unit/test_shard_plan.py
        checks the two agree), made as the groups answer: a holder's prefix starts
        with block 0, so only the lead's holders can have one; each group's answer
        bounds each holder's prefix by the group's first block the holder lacks (a
        stale group: its first block). Once no bound reaches a part's first block,
        that part and every later one (parts come in first-block order) can lower
        no prefix and hold no record of one, so they are not asked."""
        if not fresh[0]:  # every prefix ends at block 0, the lead's
            return [], None
        parts, sizes, firsts = plan.parts, plan.sizes, plan.firsts
        columns: list[dict[str, RecordColumns] | None] = [None] * len(parts)
        nodes: dict[str, NodeState] = {}
        bounds: dict[str, int] = {}
        read: tuple[int, int] | None = None
        for i, part in enumerate(parts):
            if i and (not bounds or max(bounds.values()) <= firsts[i]):
                break
            held: dict[str, int] = {}  # a stale group: its blocks count as absent
            if fresh[i]:
                m = self.mirrors[part.group_id]
                with m.lock:  # records read under the lock that keeps their slots
                    found = m.holder_prefixes(ns, part.chain, max_nodes, exclude_node)
                    if not i:
                        read = m.read_indexes()
                    if not omit_records:
                        cols = m.table.record_columns
                        columns[i] = {node.node_id: cols(slots) for node, slots in found}
                if not i:  # the lead: its holders are the only ones with a prefix
                    nodes = {node.node_id: node for node, _ in found}
                    bounds = dict.fromkeys(nodes, plan.blocks)
                held = {node.node_id: len(slots) for node, slots in found}
            n, positions = sizes[i], part.positions
            for h, bound in bounds.items():  # the first block of this part h lacks
                k = held.get(h, 0)
                if k < n and (at := positions.item(k)) < bound:
                    bounds[h] = at
        prefixes = [x for x in bounds.items() if x[1] > 0]
        best = sorted(prefixes, key=lambda x: (-x[1], x[0]))[:max_nodes]
        return [
            Merged(
                nodes[node_id],
                prefix,
                None
                if omit_records
                else plan.records(prefix, [None if c is None else c.get(node_id) for c in columns]),
            )
            for node_id, prefix in best
        ], read

    def lookup_batch(self, lookups: Sequence[pb.LookupRequest]) -> pb.LookupBatchResponse:
        check_batch(lookups, self.limits)
        resp = pb.LookupBatchResponse()
        for lk in lookups:
            resp.results.add().matches.extend(self.lookup_message(lk).matches)
        resp.read.replica_id = "mirror:shards"
        return resp

    def holders(
        self, ns_key: str, chain: Chain, max_nodes: int
    ) -> list[tuple[str, int, str, frozenset[str]]]:
        """As `Mirror.holders` (`ns_key` of kvdir.core.wire.namespace_key)."""
        return [
            (x.node.node_id, x.prefix_blocks, x.node.host, frozenset(x.node.transports))
            for x in self._lengths(ns_key, chain, max_nodes)
        ]

    def prefix_lengths(self, ns_key: str, chain: Chain, max_nodes: int) -> list[tuple[str, int]]:
        return [(x.node.node_id, x.prefix_blocks) for x in self._lengths(ns_key, chain, max_nodes)]

    def _lengths(self, ns_key: str, chain: Chain, max_nodes: int) -> list[Merged]:
        return self.merged(ns_key, chain, max_nodes, omit_records=True)

    def digests(self) -> dict[str, tuple[int, bytes]]:
        """Each group's (applied index, table digest): equal to that group's replicas'
        ClusterStatus digest at the same index (unfiltered mirrors)."""
        return {g: m.digest() for g, m in self.mirrors.items()}


class ShardedMirrorSync:
    """One `MirrorSync` per group, each feeding its group's mirror; with `follow`
    (the sharded client's `refresh_map`), a thread that moves the mirror to each
    newer map every `MAP_FOLLOW_S`."""

    def __init__(
        self,
        mirror: ShardedMirror,
        security: ClientSecurity = PLAIN,
        follow: Callable[[], ShardMap] | None = None,
    ) -> None:
        self.mirror = mirror
        self.syncs = {
            g.group_id: MirrorSync(mirror.mirrors[g.group_id], g.replicas, security)
            for g in mirror.map.groups
        }
        self._follow = follow
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._follow_map, name="kvdir-mirror-map", daemon=True
        )
        self.map_error = ""

    def _follow_map(self) -> None:
        assert self._follow is not None
        while not self._stop.wait(MAP_FOLLOW_S):
            try:
                m = self._follow()
            except DirectoryError as e:
                self.map_error = f"no shard map from the home group: {e}"
                continue
            if not self.mirror.set_map(m):
                self.map_error = f"shard map v{m.version} changes the groups: restart the mirror"
                log.warning("mirror keeps map v%d: %s", self.mirror.map.version, self.map_error)
            else:
                self.map_error = ""

    @property
    def streams(self) -> int:
        """Watch calls opened, every group's together."""
        return sum(s.streams for s in self.syncs.values())

    def start(self) -> ShardedMirrorSync:
        for s in self.syncs.values():
            s.start()
        if self._follow is not None:
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for s in self.syncs.values():
            s.stop(timeout_s)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> ShardedMirrorSync:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
