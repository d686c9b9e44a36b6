"""Merging per-group lookup answers (kvdir.core.shard_merge) against one table's answer.

The ground truth is the directory's own state machine: one `Table` holding
every entry answers the whole chain; per-group tables holding only the
entries their group owns answer their subsequences; the merge of those
answers must equal the whole table's answer message for message, and with a
group missing every prefix must end at that group's first block of the chain.
"""

from __future__ import annotations

import random

import pytest

from kvdir.core.client import records
from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.core.shard_merge import holder_prefixes, merge_lookup, subsequence
from kvdir.directory import answer
from kvdir.directory.commands import Publish, RegisterNode
from kvdir.directory.table import Table
from kvdir.v1 import directory_pb2 as pb

NS = "m\x1fbf16\x1f16\x1fpaged\x1f0/0"
NODES = [f"n{i}" for i in range(6)]


def _map(groups: int) -> ShardMap:
    return even_map([Group(f"g{i}", (f"127.0.0.1:{i + 1}",)) for i in range(groups)], 2)


def _tables(rng: random.Random, m: ShardMap, chain: list[bytes]) -> tuple[Table, dict[str, Table]]:
    """One whole table and one per group, from the same random publishes."""
    whole = Table()
    per = {g.group_id: Table() for g in m.groups}
    for t in [whole, *per.values()]:
        for i, n in enumerate(NODES):
            t.apply(RegisterNode(n, f"h{i}", f"e{i}", ("tcp",), 7, 60_000, 0))
    for n in NODES:
        upto = rng.randint(0, len(chain))
        holes = {rng.randrange(len(chain)) for _ in range(rng.randint(0, 2))}
        idx = [i for i in range(upto) if i not in holes]
        tier = rng.choice((1, 2))
        cols = (
            [rng.getrandbits(40) for _ in idx],
            [rng.randint(1, 1 << 20) for _ in idx],
            [rng.getrandbits(31) for _ in idx],
            [rng.randint(1, 1 << 40) for _ in idx],
        )
        hashes = [chain[i] for i in idx]
        whole.apply(Publish(n, 7, NS, tier, hashes, *cols))
        for g, pos in m.positions_by_group(hashes).items():
            part = [[c[j] for j in pos] for c in cols]
            per[g].apply(Publish(n, 7, NS, tier, [hashes[j] for j in pos], *part))
    return whole, per


def _answer(t: Table, chain: list[bytes], max_nodes: int) -> pb.LookupResponse:
    resp = pb.LookupResponse()
    answer.fill(resp.matches, t, t.lookup(NS, chain, max_nodes), False)
    return resp


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("seed", range(12))
def test_merge_equals_one_table(groups: int, seed: int) -> None:
    rng = random.Random(seed * 10 + groups)
    m = _map(groups)
    chain = [rng.randbytes(16) for _ in range(rng.randint(1, 60))]
    whole, per = _tables(rng, m, chain)
    positions = m.positions_by_group(chain)
    answers: dict[str, pb.LookupResponse | None] = {
        g: _answer(per[g], subsequence(chain, p), 64) for g, p in positions.items()
    }
    got = merge_lookup(len(chain), positions, answers, 64)
    assert list(got.matches) == list(_answer(whole, chain, 64).matches)
    # max_nodes truncation after the merge keeps the best holders first.
    top2 = merge_lookup(len(chain), positions, answers, 2)
    assert list(top2.matches) == list(_answer(whole, chain, 2).matches)


@pytest.mark.parametrize("seed", range(12))
def test_missing_group_ends_prefixes_at_its_first_block(seed: int) -> None:
    rng = random.Random(seed)
    m = _map(3)
    chain = [rng.randbytes(8) for _ in range(50)]
    whole, per = _tables(rng, m, chain)
    positions = m.positions_by_group(chain)
    dead = rng.choice(sorted(positions))
    answers: dict[str, pb.LookupResponse | None] = {
        g: None if g == dead else _answer(per[g], subsequence(chain, p), 64)
        for g, p in positions.items()
    }
    got = {x.node_id: x for x in merge_lookup(len(chain), positions, answers, 64).matches}
    cut = positions[dead][0]
    truth = {x.node_id: x for x in _answer(whole, chain, 64).matches}
    for node_id, want in truth.items():
        prefix = min(want.prefix_blocks, cut)
        if prefix == 0:
            assert node_id not in got
            continue
        have = got[node_id]
        assert have.prefix_blocks == prefix
        # Every record is the true one: the merge never invents or shifts a record.
        full, part = records(want), records(have)
        assert part.addresses == full.addresses[:prefix]
        assert part.generations == full.generations[:prefix]
        assert part.rkeys == full.rkeys[:prefix] and part.tiers == full.tiers[:prefix]
    assert set(got) <= set(truth)


def test_truncated_group_answer_only_shortens() -> None:
    # Group g1 answered for n0 with fewer blocks than it holds (max_nodes cut or lag):
    # n0's prefix ends at g1's first unanswered position, never beyond.
    positions = {"g0": [0, 2, 3], "g1": [1, 4]}
    a0 = pb.LookupResponse()
    a0.matches.add(node_id="n0", prefix_blocks=3)
    a1 = pb.LookupResponse()
    a1.matches.add(node_id="n0", prefix_blocks=1)
    assert holder_prefixes(5, positions, {"g0": a0, "g1": a1}) == {"n0": 4}
    a1.matches[0].prefix_blocks = 0
    assert holder_prefixes(5, positions, {"g0": a0, "g1": a1}) == {"n0": 1}
    assert holder_prefixes(5, positions, {"g0": a0, "g1": None}) == {"n0": 1}
    assert holder_prefixes(5, positions, {"g0": None, "g1": a1}) == {}


def test_omit_records_gives_lengths_only() -> None:
    rng = random.Random(5)
    m = _map(2)
    chain = [rng.randbytes(16) for _ in range(30)]
    _, per = _tables(rng, m, chain)
    positions = m.positions_by_group(chain)
    answers: dict[str, pb.LookupResponse | None] = {}
    for g, p in positions.items():
        r = pb.LookupResponse()
        t = per[g]
        answer.fill(r.matches, t, t.lookup(NS, subsequence(chain, p), 64), True)
        answers[g] = r
    got = merge_lookup(len(chain), positions, answers, 64, omit_records=True)
    assert all(not x.addresses and not x.generations for x in got.matches)
