"""`BlockIndex`: a dict's behaviour for what the table asks of it, spread over shards.

The shards exist so that no insert rehashes more than a small part of a
namespace's blocks (the module docstring has the stalls one dict gave); the
spread is what bounds that, so it is checked here rather than timed.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from kvdir.directory.block_index import SHARDS, BlockIndex


def _digest(i: int, width: int = 8) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=width).digest()


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_dict(seed: int) -> None:
    rng = random.Random(seed)
    idx, model = BlockIndex(), {}
    keys = [_digest(i, rng.choice((1, 4, 8, 32))) for i in range(400)]
    for step in range(3000):
        k = rng.choice(keys)
        op = rng.random()
        if op < 0.45:
            idx[k] = model[k] = step
        elif op < 0.6 and k in model:
            del idx[k]
            del model[k]
        elif op < 0.7:
            start = rng.randrange(10_000)
            run = [x for x in rng.sample(keys, 5) if x not in model]
            assert idx.isdisjoint(run) == model.keys().isdisjoint(run)
            idx.add_run(run, start)
            model.update(zip(run, range(start, start + len(run)), strict=True))
        assert idx.get(k, -1) == model.get(k, -1)
        assert (k in idx) == (k in model)
        assert idx.isdisjoint([k]) == (k not in model)
    assert len(idx) == len(model)
    assert dict(idx.items()) == model
    assert sorted(idx) == sorted(model)
    assert sorted(idx.values()) == sorted(model.values())


def test_restoring_from_heads_gives_the_same_index_in_the_same_order() -> None:
    keys: list[bytes | None] = [_digest(i) for i in range(1000)]
    keys[7] = None  # a free slot: never a head
    idx = BlockIndex()
    heads = [s for s in range(1000) if s != 7]
    random.Random(3).shuffle(heads)
    for s in heads:
        key = keys[s]
        assert key is not None
        idx[key] = s
    again = BlockIndex.of(keys, list(idx.values()))
    assert list(again.items()) == list(idx.items())


def test_an_empty_hash_is_a_miss_not_an_error() -> None:
    idx = BlockIndex()
    idx[b"\x01"] = 1
    assert idx.get(b"", -1) == -1
    assert b"" not in idx


def test_uniform_digests_spread_so_no_shard_holds_much_more_than_its_share() -> None:
    idx = BlockIndex()
    n = 200_000
    idx.add_run([_digest(i) for i in range(n)], 0)
    sizes = [len(d) for d in idx._shards]
    assert len(sizes) == SHARDS and sum(sizes) == n
    assert max(sizes) < 1.2 * n / SHARDS, max(sizes)  # a grow rehashes ~1/256 of the keys
    sequential = BlockIndex()  # the unit tests' hashes: i as big-endian bytes
    sequential.add_run([i.to_bytes(8, "big") for i in range(25_600)], 0)
    assert max(len(d) for d in sequential._shards) == 100
