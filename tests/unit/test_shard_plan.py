"""A sharded mirror's lookups through remembered plans answer exactly as a merge of
each group's own answers (`shard_merge.merge_lookup`, the sharded client's merge,
which the mirror's merge was first written as).

Random tables per group: several nodes publish chains that share prefixes, in
several batches (several runs per part), in both tiers (a block held twice),
with removes (gaps), wrong-group publishes (the ownership filter), a fenced
shard (that group answers nothing) and stale groups (absent). Each chain is
asked in every form (packed 8 and 16-byte hashes, a list of mixed widths),
with small `max_nodes` (a group's own cut), `exclude_node` and
`omit_records`, twice (a plan made, then remembered), and the typed reads
(`merged`, `holders`, `prefix_lengths`) agree with the message.
"""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from kvdir.agent.directory_reads import MirrorReads
from kvdir.agent.holders import Holder
from kvdir.core.client import lookup_request
from kvdir.core.mirror import NotServed, parse_lookup
from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.core.shard_merge import merge_lookup, prefix_bounds
from kvdir.core.shard_plan import Plan, Plans
from kvdir.core.shard_route import Router
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.directory.commands import FreezeShard, Publish, RegisterNode, Remove
from kvdir.directory.lookup import Chain
from kvdir.v1 import directory_pb2 as pb
from tests.unit.test_mirror import Clock, pb_ns

NS = ("m\x1f\x1f16\x1f\x1f0/0", "n\x1f\x1f16\x1f\x1f0/0")
NODES = [f"n{i}" for i in range(5)]


def reference(mirror: ShardedMirror, req: pb.LookupRequest) -> pb.LookupResponse:
    """The answer by the definition: each fresh group asked for its part by a
    request of its own, the answers merged as the sharded client merges them."""
    _, chain, max_nodes = parse_lookup(req, mirror.limits)
    hs = chain.items()
    pos = mirror.map.positions_by_group(hs)
    fresh = {g for g in pos if mirror.mirrors[g].fresh()}
    if not fresh:
        raise NotServed("stale", "")
    if len(pos) == 1:
        return mirror.mirrors[next(iter(pos))].lookup_message(req)
    answers: dict[str, pb.LookupResponse | None] = {}
    for g, p in pos.items():
        sub = lookup_request(
            req.namespace, [hs[i] for i in p], req.max_nodes, req.exclude_node, req.omit_records
        )
        answers[g] = mirror.mirrors[g].lookup_message(sub) if g in fresh else None
    resp = merge_lookup(len(hs), pos, answers, max_nodes, req.omit_records)
    resp.read.replica_id = "mirror:shards"
    return resp


def _hash(rng: random.Random, width: int) -> bytes:
    return rng.randbytes(width)


def _chains(rng: random.Random) -> list[tuple[str, list[bytes]]]:
    """Chains that share prefixes (turns of conversations), of several widths."""
    out: list[tuple[str, list[bytes]]] = []
    for _ in range(6):
        width = rng.choice((8, 8, 8, 16))
        base = [_hash(rng, width) for _ in range(rng.randrange(1, 40))]
        ns = rng.choice(NS)
        out.append((ns, base))
        for _ in range(rng.randrange(3)):  # a next turn: the last one's chain, extended
            base = base + [_hash(rng, width) for _ in range(rng.randrange(1, 30))]
            out.append((ns, base))
    mixed = out[0][1][:5] + [_hash(rng, 16)] + [_hash(rng, 8) for _ in range(6)]
    out.append((out[0][0], mixed))
    return out


def _publish(
    mirror: ShardedMirror, rng: random.Random, node: str, ns: str, hs: list[bytes], tier: int
) -> None:
    """`hs` published by `node` as a sharded client sends it: split by owner, each
    group's part in one or two batches."""
    tag = rng.randrange(1 << 20)
    for g, p in mirror.map.positions_by_group(hs).items():
        cut = rng.randrange(len(p) + 1)
        for batch in (p[:cut], p[cut:]):
            if batch:
                mirror.mirrors[g].table.apply(_entries(node, ns, [hs[i] for i in batch], tier, tag))


def _entries(node: str, ns: str, hs: list[bytes], tier: int, tag: int) -> Publish:
    n = len(hs)
    addrs = [tag * 4096 + i for i in range(n)]
    return Publish(node, 1, ns, tier, hs, addrs, [64] * n, [tag % 997 + 1] * n, [tier] * n)


def _stray(mirror: ShardedMirror, rng: random.Random, ns: str, hs: list[bytes]) -> None:
    """Blocks published into a group that does not own them (never to be read)."""
    into = rng.choice(mirror.map.groups).group_id
    wrong = [h for h in hs if mirror.map.shard_of(h).group_id != into]
    if wrong:
        mirror.mirrors[into].table.apply(_entries(rng.choice(NODES), ns, wrong, 1, 0xDEAD))


def _mirror(seed: int, groups: int) -> tuple[ShardedMirror, list[tuple[str, list[bytes]]]]:
    rng = random.Random(seed)
    m = even_map([Group(f"g{i}", (f"h:{i + 1}",)) for i in range(groups)], 2)
    mirror = ShardedMirror(m, clock=Clock())
    for mg in mirror.mirrors.values():
        for n in NODES:
            mg.table.apply(RegisterNode(n, f"host-{n}", f"ep-{n}", ("tcp", n), 1, 60_000, 0))
    chains = _chains(rng)
    for ns, hs in chains:
        for node in rng.sample(NODES, rng.randrange(1, 4)):
            if len(set(map(len, hs))) > 1:
                continue  # engines publish one width per namespace
            upto = rng.randrange(1, len(hs) + 1)
            _publish(mirror, rng, node, ns, hs[:upto], rng.choice((1, 1, 2)))
            if rng.random() < 0.3:  # the same blocks in the other tier too
                _publish(mirror, rng, node, ns, hs[: rng.randrange(1, upto + 1)], 2)
            if rng.random() < 0.3:  # a gap
                gone = rng.choice(hs[:upto])
                g = mirror.map.shard_of(gone).group_id
                mirror.mirrors[g].table.apply(Remove(node, 1, ns, 1, [gone]))
        if rng.random() < 0.3:
            _stray(mirror, rng, ns, hs)
    for mg in mirror.mirrors.values():
        mg.ready, mg.cluster_id = True, ""
        mg.on_event(pb.WatchEvent(heartbeat=pb.WatchHeartbeat(), applied_index=0))
    if rng.random() < 0.3:  # a shard moving away: its group answers nothing for it
        s = rng.choice(m.shards)
        mirror.mirrors[s.group_id].table.apply(FreezeShard(s.shard_id, s.lo, s.hi))
    if rng.random() < 0.3:  # a stale group: its blocks count as absent
        mirror.mirrors[rng.choice(m.groups).group_id].ready = False
    return mirror, chains


def _requests(rng: random.Random, ns: str, hs: list[bytes]) -> list[pb.LookupRequest]:
    out = []
    for _ in range(3):
        req = lookup_request(
            pb_ns(ns),
            hs,
            rng.choice((0, 1, 2, 8)),
            rng.choice(("", "", rng.choice(NODES))),
            rng.random() < 0.3,
        )
        out.append(req)
    if len(set(map(len, hs))) == 1:
        listed = pb.LookupRequest()
        listed.CopyFrom(out[0])
        listed.ClearField("packed_hashes")
        listed.ClearField("hash_width")
        listed.block_hashes.extend(hs)  # the same chain, not packed
        out.append(listed)
    return out


def _answer(mirror: ShardedMirror, req: pb.LookupRequest) -> pb.LookupResponse | str:
    try:
        return mirror.lookup_message(req)
    except NotServed as e:
        return e.reason


def _expected(mirror: ShardedMirror, req: pb.LookupRequest) -> pb.LookupResponse | str:
    try:
        return reference(mirror, req)
    except NotServed as e:
        return e.reason


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(12))
def test_lookups_equal_the_merge_of_each_groups_answer(groups: int, seed: int) -> None:
    mirror, chains = _mirror(seed, groups)
    rng = random.Random(seed + 1000)
    for mg in mirror.mirrors.values():
        assert mg.fresh() == mg.lag().fresh
    for ns, hs in chains:
        for req in _requests(rng, ns, hs):
            want = _expected(mirror, req)
            for _ in range(2):  # the plan made, then the plan remembered
                assert _answer(mirror, req) == want
            if isinstance(want, str) or req.block_hashes:
                continue
            _, chain, max_nodes = parse_lookup(req, mirror.limits)
            typed = mirror.merged(ns, chain, max_nodes, req.exclude_node, req.omit_records)
            assert [(x.node.node_id, x.prefix_blocks) for x in typed] == [
                (x.node_id, x.prefix_blocks) for x in want.matches
            ]
            for x, w in zip(typed, want.matches, strict=True):
                assert (x.node.host, x.node.endpoint, list(x.node.transports)) == (
                    w.host,
                    w.agent_endpoint,
                    list(w.transports),
                )
                if not req.omit_records:
                    assert x.records is not None
                    assert (
                        x.records.addresses,
                        x.records.lengths,
                        x.records.rkeys,
                        x.records.generations,
                        x.records.tiers,
                    ) == (w.addresses, w.lengths, w.rkeys, w.generations, w.tiers)
            if not req.exclude_node:
                lengths = [(x.node_id, x.prefix_blocks) for x in want.matches]
                assert mirror.prefix_lengths(ns, Chain.of(hs), max_nodes) == lengths


def test_plans_are_remembered_and_bounded() -> None:
    m = even_map([Group("g0", ("a:1",)), Group("g1", ("b:1",))], 2)
    plans = Plans(Router(m), blocks_max=100)
    chains = [Chain.of([bytes([c, i]) * 4 for i in range(30)]) for c in range(5)]
    first = plans.plan(chains[0])
    assert plans.plan(Chain(bytes(chains[0].data), 8)) is first  # by content
    assert plans.plan(Chain(chains[0].data, 4)) is not first  # another width: another chain
    for c in chains[1:]:
        plans.plan(c)
    assert plans._blocks <= 100
    assert plans.plan(chains[0]) is not first  # the oldest went first
    assert plans.plan(chains[-1]) is plans.plan(chains[-1])
    # Two chains that end alike (one key among the plans): each gets its own plan.
    tail = [b"t" * 8, b"u" * 8]
    a, b = Chain.of([b"a" * 8, *tail]), Chain.of([b"b" * 8, *tail])
    for c in (a, b, a, b):
        for part in plans.plan(c).parts:
            assert part.chain.items() == [c.item(int(i)) for i in part.positions]


@pytest.mark.parametrize("seed", range(20))
def test_plan_records_follow_the_merge(seed: int) -> None:
    rng = random.Random(seed)
    groups = rng.randrange(1, 5)
    m = even_map([Group(f"g{i}", (f"h:{i}",)) for i in range(groups)], 3)
    hs = [rng.randbytes(8) for _ in range(rng.randrange(1, 60))]
    plan = Plan.of(Chain.of(hs), Router(m).positions(hs))
    pos = {p.group_id: p.positions for p in plan.parts}
    assert {g: list(p) for g, p in pos.items()} == m.positions_by_group(hs)
    holders = ["a", "b", "c"]
    prefixes: list[dict[str, int] | None] = []
    for p in plan.parts:
        if rng.random() < 0.15:
            prefixes.append(None)
        else:
            prefixes.append({h: rng.randrange(len(p.positions) + 1) for h in holders})
    groups_prefixes = {p.group_id: got for p, got in zip(plan.parts, prefixes, strict=True)}
    bounds = prefix_bounds(len(hs), pos, groups_prefixes)
    for h, prefix in bounds.items():
        got = []
        for p, per in zip(plan.parts, prefixes, strict=True):
            k = 0 if per is None else per.get(h, 0)
            # Record i of a part is its chain position, in every column.
            at = [int(x) for x in p.positions[:k]]
            got.append(
                None
                if per is None or not k
                else (
                    b"".join(x.to_bytes(8, "little") for x in at),
                    b"".join((x + 1).to_bytes(4, "little") for x in at),
                    b"".join((x + 2).to_bytes(4, "little") for x in at),
                    b"".join((x + 3).to_bytes(8, "little") for x in at),
                    bytes(x % 256 for x in at),
                )
            )
        r = plan.records(prefix, got)
        assert r.addresses == b"".join(i.to_bytes(8, "little") for i in range(prefix))
        assert r.lengths == b"".join((i + 1).to_bytes(4, "little") for i in range(prefix))
        assert r.rkeys == b"".join((i + 2).to_bytes(4, "little") for i in range(prefix))
        assert r.generations == b"".join((i + 3).to_bytes(8, "little") for i in range(prefix))
        assert r.tiers == bytes(i % 256 for i in range(prefix))


def test_a_map_of_one_group_plans_without_routing() -> None:
    m = ShardMap(1, (Group("g0", ("a:1",)),), even_map([Group("g0", ("a:1",))]).shards)
    plan = Plans(Router(m)).plan(Chain.of([b"x" * 8, b"y" * 8]))
    assert [p.group_id for p in plan.parts] == ["g0"] and plan.lead_run == 2


class Replicas:
    """The RPC path's stand-in: counts what reaches it."""

    def __init__(self) -> None:
        self.asked = 0

    def lookup_message(self, req: pb.LookupRequest) -> pb.LookupResponse:
        self.asked += 1
        resp = pb.LookupResponse()
        resp.matches.add(node_id="from-rpc", prefix_blocks=1)
        return resp


def test_the_agents_holders_come_off_the_typed_merge() -> None:
    """The agent's fetch path reads holders from a sharded mirror with no message
    built: the same holders as the message's; a stale mirror's go to the replicas."""
    mirror, chains = _mirror(7, 3)
    for mg in mirror.mirrors.values():
        mg.ready = True
    replicas = Replicas()
    reads = MirrorReads(cast("Any", replicas), mirror, ShardedMirrorSync(mirror))
    asked = 0
    for ns, hs in chains:
        for max_nodes, exclude in ((8, ""), (1, ""), (8, NODES[0])):
            want = reference(mirror, lookup_request(pb_ns(ns), hs, max_nodes, exclude))
            got = reads.holders(pb_ns(ns), hs, max_nodes, exclude)
            assert got == [Holder.of(x) for x in want.matches]
            asked += 1
    assert asked > 10 and reads.lookups == asked and reads.fallbacks == 0 and not replicas.asked
    for mg in mirror.mirrors.values():
        mg.ready = False
    ns, hs = chains[0]
    assert [h.node_id for h in reads.holders(pb_ns(ns), hs, 8)] == ["from-rpc"]
    assert (reads.fallbacks, replicas.asked) == (1, 1)
