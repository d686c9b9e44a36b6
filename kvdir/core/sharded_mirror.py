"""An in-process mirror of a sharded directory: every group's Watch into one table.

`ShardedMirror` has `Mirror`'s read API (the same `LookupResponse` messages,
`holders`, `prefix_lengths`, `lag`) over one union `Table`, fed by one
`GroupFeed` per group (each kept fed by its own `MirrorSync`). Lookups are
the table's own in-process lookups on the union: no per-block routing on the
read path while every group's stream is fresh.

Ownership filter: an event from group g applies only the entries whose keys
g owns under the mirror's map: a Publish or Remove is cut to them, a
ClearNode that is not a deregistration removes only g's entries of the node,
and a group's snapshot replaces only g's entries of the union. This is what
keeps a move safe later (an old owner's stream can no longer touch a shard it
gave away) and keeps one group's node-wide command from dropping what
another group published after it. Node-wide state (registration,
incarnation, lease) is shared: a new incarnation registered in any group
drops the node's old entries everywhere (every group drops them too), and
commands of an older incarnation are refused by the union as by a replica.
A group that expires a node its peers still hold (it was cut off from the
agent's heartbeats) drops the node from the union; the agent then hears
`unknown-node` from that group, registers again and re-publishes everything,
so the union converges; until then those blocks are misses.

Guarantee per group, as `Mirror`'s: what the union holds of group g is g's
committed table at that feed's `applied_index` (filtered), and it never goes
backwards. Freshness is per group: every lookup checks every feed; when some
groups are stale (silent or behind for more than `max_staleness_s`, or not yet
started) the chain is cut at its first block owned by a stale group (its
blocks count as absent: a miss, not an error); when every group is stale the
mirror raises `NotServed` and callers ask the replicas.

Thread-safety: each feed runs on its stream's thread; all of them apply under
the one `lock` (a bounded chunk at a time), lookups take it too.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from kvdir.core.client import DirectoryError, lookup_request
from kvdir.core.mirror import (
    APPLY_BYTES_PER_LOCK,
    COMMITS_TRACKED_MAX,
    MAX_STALENESS_S_DEFAULT,
    SNAPSHOT_BYTES_MAX,
    Lag,
    MirrorError,
    NotServed,
    Resync,
)
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.shard_map import ShardMap
from kvdir.directory import answer, codec, snapshot, validate
from kvdir.directory.commands import ClearNode, Command, Publish, RegisterNode, Remove
from kvdir.directory.limits import RequestLimits
from kvdir.directory.lookup import Chain
from kvdir.directory.table import NIL, Table
from kvdir.v1 import directory_pb2 as pb

MERGE_ENTRIES_PER_LOCK = 4096
"""Snapshot entries merged into the union per hold of the lock."""


@dataclass(frozen=True, slots=True)
class GroupLag:
    group_id: str
    lag: Lag
    error: str
    source: str


class GroupFeed:
    """One group's Watch stream into the union (what `MirrorSync` feeds)."""

    def __init__(self, mirror: ShardedMirror, group_id: str) -> None:
        self.mirror = mirror
        self.group_id = group_id
        self.applied_index = 0
        self.commit_index = 0
        self.ready = False
        self.cluster_id: str | None = None
        self.holds_entries = False
        """Whether the union may hold entries of this group (a snapshot or a command applied)."""
        self.source = ""
        self.error = ""
        self.snapshots = 0
        self.resyncs = 0
        self._heard = -float("inf")
        self._commits: deque[tuple[int, float]] = deque()
        self._snap = bytearray()
        self._snap_index = 0

    @property
    def watched(self) -> list[pb.Namespace]:
        return self.mirror.watched

    # ---------------------------------------------------------- stream side

    def resume_index(self) -> int:
        self._snap = bytearray()
        return self.applied_index if self.ready else 0

    def fail(self, message: str) -> None:
        self.error = message

    def on_event(self, ev: pb.WatchEvent) -> None:
        """Apply one Watch event of this group (raises as `Mirror.on_event`)."""
        if ev.command_version and ev.command_version != codec.VERSION:
            raise MirrorError(
                f"group {self.group_id}: the replica sends command format "
                f"{ev.command_version}; this mirror applies {codec.VERSION}"
            )
        now = self.mirror.clock()
        kind = ev.WhichOneof("event")
        if self.ready and ev.cluster_id != self.cluster_id:
            self._forget(ev.cluster_id, ev.replica_id)
            if kind != "snapshot":
                raise Resync(
                    f"group {self.group_id}: replica {ev.replica_id!r} serves cluster "
                    f"{ev.cluster_id!r}, the mirror's part is of {self.cluster_id!r}"
                )
        self._heard_commit(ev.commit_index, now)
        if kind == "snapshot":
            self._on_snapshot(ev.snapshot, ev.cluster_id)
        elif kind == "entries":
            self._on_entries(ev.entries)
        if self.ready and not self._snap:
            with self.mirror.lock:
                self.applied_index = max(self.applied_index, ev.applied_index)
        self.source = ev.replica_id

    def _forget(self, cluster_id: str, replica_id: str) -> None:
        self.ready = False
        self.mirror.drop_group(self.group_id)
        self.holds_entries = False
        self.applied_index = self.commit_index = 0
        self._commits.clear()
        self._snap = bytearray()
        self.resyncs += 1
        self.error = f"replica {replica_id!r} serves cluster {cluster_id!r}: resynchronising"

    def _on_snapshot(self, s: pb.WatchSnapshot, cluster_id: str) -> None:
        if not self._snap:
            if s.total_bytes > SNAPSHOT_BYTES_MAX:
                raise MirrorError(f"a snapshot of {s.total_bytes} bytes is over the limit")
            self._snap_index = s.index
        elif s.index != self._snap_index:
            raise MirrorError(f"snapshot chunk of index {s.index} inside {self._snap_index}'s")
        self._snap += s.data
        if not s.last:
            return
        data, self._snap = bytes(self._snap), bytearray()
        if len(data) != s.total_bytes:
            raise MirrorError(f"snapshot of {len(data)} bytes, announced {s.total_bytes}")
        if self.ready and s.index <= self.applied_index:
            return
        try:
            table, _, _ = snapshot.load(io.BytesIO(data), "watch snapshot")
        except (snapshot.SnapshotError, ValueError, KeyError) as e:
            raise MirrorError(f"bad snapshot: {e}") from e
        # Not ready while the union's part of this group is being replaced: lookups
        # treat its blocks as absent meanwhile, never as a mix of two states.
        self.ready = False
        if self.holds_entries:
            self.mirror.drop_group(self.group_id)
        self.holds_entries = True
        self.mirror.merge_table(self.group_id, table)
        with self.mirror.lock:
            self.applied_index = s.index
            self.cluster_id = cluster_id
            self.ready = True
        self.snapshots += 1

    def _on_entries(self, e: pb.WatchEntries) -> None:
        if len(e.indexes) != len(e.commands):
            raise MirrorError(f"{len(e.indexes)} indexes for {len(e.commands)} commands")
        if not self.ready:
            raise MirrorError("commands before any starting point (a snapshot)")
        todo: list[tuple[int, Command, int]] = []
        for index, blob in zip(e.indexes, e.commands, strict=True):
            if index <= self.applied_index:
                continue
            try:
                todo.append((index, codec.decode(blob), len(blob)))
            except codec.CodecError as err:
                raise MirrorError(f"command at index {index}: {err}") from err
        owned = [(i, self.mirror.owned_part(self.group_id, c), n) for i, c, n in todo]
        self.holds_entries = True
        i = 0
        while i < len(owned):
            size = 0
            with self.mirror.lock:
                while i < len(owned) and (size == 0 or size + owned[i][2] <= APPLY_BYTES_PER_LOCK):
                    index, cmd, n = owned[i]
                    if cmd is not None:
                        self.mirror.apply_owned(self.group_id, cmd)
                    self.applied_index = index
                    size += n
                    i += 1

    def _heard_commit(self, commit_index: int, now: float) -> None:
        self._heard = now
        if commit_index > self.commit_index:
            self.commit_index = commit_index
            self._commits.append((commit_index, now))
            if len(self._commits) > COMMITS_TRACKED_MAX:
                self._commits.popleft()

    def lag(self) -> Lag:
        now = self.mirror.clock()
        applied = self.applied_index
        while self._commits and self._commits[0][0] <= applied:
            self._commits.popleft()
        behind_ms = (now - self._commits[0][1]) * 1000 if self._commits else 0.0
        silent_ms = (now - self._heard) * 1000
        limit_ms = self.mirror.max_staleness_s * 1000
        fresh = self.ready and silent_ms <= limit_ms and behind_ms <= limit_ms
        entries = max(0, self.commit_index - applied)
        return Lag(applied, self.commit_index, entries, behind_ms, silent_ms, fresh)


class ShardedMirror:
    def __init__(
        self,
        shard_map: ShardMap,
        max_staleness_s: float = MAX_STALENESS_S_DEFAULT,
        namespaces: Iterable[pb.Namespace] = (),
        clock: Callable[[], float] = time.monotonic,
        limits: RequestLimits | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.table = Table()
        self.map = shard_map
        self.max_staleness_s = max_staleness_s
        self.watched = list(namespaces)
        self.namespaces = frozenset(validate.namespace_key(ns) for ns in self.watched) or None
        self.limits = limits or RequestLimits()
        self.clock = clock
        self.feeds = {g.group_id: GroupFeed(self, g.group_id) for g in shard_map.groups}

    # ------------------------------------------------------- ownership filter

    def _owned(self, group_id: str, hashes: Sequence[bytes]) -> list[int] | None:
        """Positions of `hashes` that `group_id` owns; None when it owns them all."""
        pos = self.map.positions_by_group(hashes).get(group_id, [])
        return None if len(pos) == len(hashes) else pos

    def owned_part(self, group_id: str, cmd: Command) -> Command | None:
        """The part of `cmd` group `group_id` may apply (None: nothing). Pure on the
        map: called outside the lock."""
        match cmd:
            case Publish():
                pos = self._owned(group_id, cmd.hashes)
                if pos is None:
                    return cmd
                if not pos:
                    return None
                return Publish(
                    cmd.node_id,
                    cmd.incarnation,
                    cmd.namespace,
                    cmd.tier,
                    [cmd.hashes[i] for i in pos],
                    [cmd.addresses[i] for i in pos],
                    [cmd.lengths[i] for i in pos],
                    [cmd.rkeys[i] for i in pos],
                    [cmd.generations[i] for i in pos],
                )
            case Remove():
                pos = self._owned(group_id, cmd.hashes)
                if pos is None:
                    return cmd
                if not pos:
                    return None
                n = len(cmd.hashes)
                return Remove(
                    cmd.node_id,
                    cmd.incarnation,
                    cmd.namespace,
                    cmd.tier,
                    [cmd.hashes[i] for i in pos],
                    [cmd.generations[i] for i in pos] if len(cmd.generations) == n else [],
                    [cmd.addresses[i] for i in pos] if len(cmd.addresses) == n else [],
                )
        return cmd

    def apply_owned(self, group_id: str, cmd: Command) -> None:
        """Apply `owned_part`'s result to the union; under `lock`."""
        if isinstance(cmd, ClearNode) and not cmd.deregister:
            self._clear_owned(group_id, cmd)
            return
        self.table.apply(cmd)

    def _clear_owned(self, group_id: str, cmd: ClearNode) -> None:
        """ClearNode of group g: remove only g's entries of the node (in the namespace)."""
        t = self.table
        node = t.nodes.get(cmd.node_id)
        if node is None or node.incarnation != cmd.incarnation:
            return
        ns = None if cmd.namespace is None else t.ns_ids.get(cmd.namespace)
        if cmd.namespace is not None and ns is None:
            return
        c = t.col
        by: dict[tuple[int, int], list[bytes]] = {}
        s = node.head
        while s != NIL:
            key = c.key[s]
            if key is not None and (ns is None or c.ns[s] == ns):
                by.setdefault((c.ns[s], c.tier[s]), []).append(key)
            s = c.nnext[s]
        for (n, tier), keys in by.items():
            pos = self.map.positions_by_group(keys).get(group_id, [])
            if pos:
                t.apply(
                    Remove(
                        cmd.node_id, cmd.incarnation, t.ns_names[n], tier, [keys[i] for i in pos]
                    )
                )

    def drop_group(self, group_id: str) -> None:
        """Remove every union entry group `group_id` owns (before its new snapshot).

        One hold of the lock, proportional to the union: rare (a stream that fell
        behind its replicas' history, or a restored cluster)."""
        with self.lock:
            t = self.table
            c = t.col
            by: dict[tuple[int, int, int], list[bytes]] = {}
            for n, blocks in enumerate(t.blocks):
                keys = list(blocks)
                for i in self.map.positions_by_group(keys).get(group_id, []):
                    s = blocks.get(keys[i], NIL)
                    while s != NIL:
                        by.setdefault((c.node[s], n, c.tier[s]), []).append(keys[i])
                        s = c.bnext[s]
            for (nidx, n, tier), keys in by.items():
                node = t.node_by_idx[nidx]
                assert node is not None, "a slot points at a forgotten node"
                t.apply(Remove(node.node_id, node.incarnation, t.ns_names[n], tier, keys))

    def merge_table(self, group_id: str, src: Table) -> None:
        """Add `src`'s entries that group `group_id` owns to the union (a snapshot)."""
        with self.lock:
            for node in src.nodes.values():
                self.table.apply(
                    RegisterNode(
                        node.node_id,
                        node.host,
                        node.endpoint,
                        node.transports,
                        node.incarnation,
                        node.lease_ms,
                        node.lease_expiry_ms - node.lease_ms,
                    )
                )
        c = src.col
        batches: dict[tuple[int, int, int], list[int]] = {}
        for n, blocks in enumerate(src.blocks):
            keys = list(blocks)
            for i in self.map.positions_by_group(keys).get(group_id, []):
                s = blocks.get(keys[i], NIL)
                while s != NIL:
                    batches.setdefault((c.node[s], n, c.tier[s]), []).append(s)
                    s = c.bnext[s]
        for (nidx, n, tier), slots in batches.items():
            holder = src.node_by_idx[nidx]
            assert holder is not None, "a slot points at a forgotten node"
            for i in range(0, len(slots), MERGE_ENTRIES_PER_LOCK):
                part = slots[i : i + MERGE_ENTRIES_PER_LOCK]
                cmd = Publish(
                    holder.node_id,
                    holder.incarnation,
                    src.ns_names[n],
                    tier,
                    [k for k in (c.key[s] for s in part) if k is not None],
                    [c.addr[s] for s in part],
                    [c.length[s] for s in part],
                    [c.rkey[s] for s in part],
                    [c.gen[s] for s in part],
                )
                with self.lock:
                    self.table.apply(cmd)

    # ------------------------------------------------------------- staleness

    @property
    def snapshots(self) -> int:
        """Snapshots loaded, every group's together."""
        return sum(f.snapshots for f in self.feeds.values())

    def group_lags(self) -> list[GroupLag]:
        return [GroupLag(g, f.lag(), f.error, f.source) for g, f in self.feeds.items()]

    def lag(self) -> Lag:
        """The worst group's lag (fresh only when every group is)."""
        lags = [f.lag() for f in self.feeds.values()]
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

    def _stale_groups(self, ns_key: str) -> set[str]:
        """Groups whose blocks count as absent now; NotServed when all are."""
        if self.namespaces is not None and ns_key not in self.namespaces:
            raise NotServed("namespace-not-mirrored", "this mirror does not hold that namespace")
        stale = {g for g, f in self.feeds.items() if not f.lag().fresh}
        if len(stale) == len(self.feeds):
            raise NotServed("stale", "every group's stream is stale; ask the replicas")
        return stale

    def _cut(self, chain: Chain, stale: set[str]) -> Chain:
        """`chain` up to its first block owned by a stale group."""
        if not stale:
            return chain
        items = chain.items()
        pos = self.map.positions_by_group(items)
        cut = min((pos[g][0] for g in stale if g in pos), default=len(items))
        return chain if cut == len(items) else Chain.of(items[:cut])

    # ----------------------------------------------------------------- reads

    def _fill_read(self, info: pb.ReadInfo) -> None:
        """The union's indexes are sums over groups: they only grow (a progress
        counter), but are no one log's index."""
        lag = self.lag()
        info.replica_id = "mirror:shards"
        info.applied_index = lag.applied_index
        info.commit_index = max(lag.commit_index, lag.applied_index)

    def read_info(self) -> pb.ReadInfo:
        info = pb.ReadInfo()
        self._fill_read(info)
        return info

    def _parse(self, req: pb.LookupRequest) -> tuple[str, Chain, int]:
        try:
            return validate.lookup_chain(req, self.limits)
        except validate.BadRequest as e:
            raise DirectoryError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.reason) from e

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        """As `Mirror.lookup_message`, from the union of the fresh groups."""
        if req.linearizable:
            raise NotServed("linearizable", "a mirror serves local reads only")
        ns, chain, max_nodes = self._parse(req)
        chain = self._cut(chain, self._stale_groups(ns))
        resp = pb.LookupResponse()
        if len(chain):
            with self.lock:
                matches = self.table.lookup(ns, chain, max_nodes, req.exclude_node)
                answer.fill(resp.matches, self.table, matches, req.omit_records)
        self._fill_read(resp.read)
        return resp

    def lookup(
        self,
        ns: pb.Namespace,
        chain: Sequence[bytes],
        max_nodes: int = 0,
        exclude_node: str = "",
        omit_records: bool = False,
    ) -> pb.LookupResponse:
        return self.lookup_message(lookup_request(ns, chain, max_nodes, exclude_node, omit_records))

    def lookup_batch(self, lookups: Sequence[pb.LookupRequest]) -> pb.LookupBatchResponse:
        if len(lookups) > self.limits.lookup_batch_max:
            raise DirectoryError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(lookups)} lookups is over the limit of {self.limits.lookup_batch_max}",
                "too-many-lookups",
            )
        resp = pb.LookupBatchResponse()
        for lk in lookups:
            one = self.lookup_message(lk)
            resp.results.add().matches.extend(one.matches)
        self._fill_read(resp.read)
        return resp

    def holders(
        self, ns_key: str, chain: Chain, max_nodes: int
    ) -> list[tuple[str, int, str, frozenset[str]]]:
        chain = self._cut(chain, self._stale_groups(ns_key))
        if not len(chain):
            return []
        with self.lock:
            return [
                (m.node.node_id, m.prefix_blocks, m.node.host, frozenset(m.node.transports))
                for m in self.table.lookup(ns_key, chain, max_nodes)
            ]

    def prefix_lengths(self, ns_key: str, chain: Chain, max_nodes: int) -> list[tuple[str, int]]:
        chain = self._cut(chain, self._stale_groups(ns_key))
        if not len(chain):
            return []
        with self.lock:
            return self.table.prefix_lengths(ns_key, chain, max_nodes)

    def entries_digest(self) -> bytes:
        """SHA-256 of the union's (namespace, block, node, record) rows in canonical
        order: equal to `entries_digest` of the groups' tables taken together."""
        with self.lock:
            return entries_digest([self.table])


def entries_digest(tables: Sequence[Table]) -> bytes:
    """The (namespace, block, node, tier, record) rows of `tables` together, hashed in
    sorted order (node leases and slot layout left out)."""
    rows = []
    for t in tables:
        c = t.col
        for n, blocks in enumerate(t.blocks):
            name = t.ns_names[n]
            for key, head in blocks.items():
                s = head
                while s != NIL:
                    node = t.node_by_idx[c.node[s]]
                    nid = "" if node is None else node.node_id
                    rows.append(
                        (name, key, nid, c.tier[s], c.addr[s], c.length[s], c.rkey[s], c.gen[s])
                    )
                    s = c.bnext[s]
    rows.sort()
    h = hashlib.sha256()
    for row in rows:
        h.update(repr(row).encode())
    return h.digest()


class ShardedMirrorSync:
    """One `MirrorSync` per group, each feeding its group's part of `mirror`."""

    def __init__(self, mirror: ShardedMirror, security: ClientSecurity = PLAIN) -> None:
        self.mirror = mirror
        self.syncs = {
            g.group_id: MirrorSync(mirror.feeds[g.group_id], g.replicas, security)
            for g in mirror.map.groups
        }

    @property
    def streams(self) -> int:
        """Watch calls opened, every group's together."""
        return sum(s.streams for s in self.syncs.values())

    def start(self) -> ShardedMirrorSync:
        for s in self.syncs.values():
            s.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        for s in self.syncs.values():
            s.stop(timeout_s)

    def __enter__(self) -> ShardedMirrorSync:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
