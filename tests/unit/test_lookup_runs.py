"""Prefixes stored as several runs of slots: a chain published over several commands.

An engine publishes per request, so a conversation's prefix reaches the table
one turn at a time, and a batch boundary splits a chain too. Such a prefix is
answered as `Runs` (one range per command) and its records are sliced per run;
these tests pin that the answer, the records and the wire form are those of the
one-command publish of the same blocks.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvdir.directory.lookup import Chain, Runs, _common_words, fingerprint, fingerprints
from kvdir.directory.table import Table
from tests.unit.helpers import NS, chain, must_publish, must_register, packed, publish_cmd, view


def _split_publish(t: Table, node: str, hashes: list[bytes], cuts: list[int], addr: int) -> None:
    """Publish `hashes` as one command per piece between `cuts`, with filler
    from another node in between so that the pieces do not land side by side."""
    bounds = [0, *cuts, len(hashes)]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        t.apply(publish_cmd(node, hashes[a:b], addr=addr + a))
        t.apply(publish_cmd("filler", chain(3, start=10_000 + 10 * k)))


@pytest.mark.parametrize("width", [8, 16, 4])
def test_a_prefix_in_several_runs_answers_as_one_publish_would(width: int) -> None:
    hashes = chain(40, width=width)
    split, whole = Table(), Table()
    for t in (split, whole):
        must_register(t, "a")
        must_register(t, "filler")
    _split_publish(split, "a", hashes, [7, 8, 25], addr=0x1000)
    must_publish(whole, "a", hashes, addr=0x1000)
    (m,) = split.lookup(NS, hashes, 8)
    assert isinstance(m.slots, Runs)
    assert [len(r) for r in m.slots.ranges] == [7, 1, 17, 15]
    assert view(split, hashes) == view(whole, hashes)
    assert split.packed_records(m.slots) == packed(split.records(m.slots))


def test_a_prefix_ends_where_a_later_run_breaks() -> None:
    hashes = chain(30)
    t = Table()
    must_register(t, "a")
    must_register(t, "filler")
    _split_publish(t, "a", hashes[:20], [10], addr=0)  # blocks 20.. are never published
    t.apply(publish_cmd("a", [b"\xff" * 8, *hashes[21:]], addr=500))
    assert view(t, hashes)[0][1] == 20


def test_a_row_that_does_not_match_its_block_ends_the_prefix_and_never_loops() -> None:
    """The block index names a slot, the slot's row (here its fingerprint, damaged by
    the test) does not hold that block: the prefix ends there; following runs must
    not probe that slot again forever."""
    hashes = chain(30)
    t = Table()
    must_register(t, "a")
    must_register(t, "filler")
    _split_publish(t, "a", hashes, [10], addr=0)
    (m,) = t.lookup(NS, hashes, 8)
    slot = list(m.slots)[10]  # the second run's first slot: reached by a probe
    t.col.fp[slot] ^= 1
    assert view(t, hashes)[0][1] == 10
    assert t.prefix_lengths(NS, Chain.of(hashes), 8) == [("a", 10)]


def test_runs_is_a_sequence_of_its_slots() -> None:
    r = Runs([range(5, 8), range(20, 21), range(2, 4)])
    want = [5, 6, 7, 20, 2, 3]
    assert len(r) == len(want)
    assert list(r) == want
    assert [r[i] for i in range(-len(want), len(want))] == want + want
    assert r[1:5] == want[1:5]
    for bad in (len(want), -len(want) - 1):
        with pytest.raises(IndexError):
            r[bad]


def test_common_words_finds_the_first_differing_word() -> None:
    rng = random.Random(7)
    for _ in range(300):
        k = rng.randint(1, 70)
        a = bytes(rng.getrandbits(8) for _ in range(8 * k))
        at = rng.randrange(k)
        flip = 8 * at + rng.randrange(8)
        b = a[:flip] + bytes([a[flip] ^ (1 << rng.randrange(8))]) + a[flip + 1 :]
        assert _common_words(a, b, k) == at


@pytest.mark.parametrize("width", [1, 4, 8, 9, 32])
def test_chain_fingerprints_are_the_columns_fingerprints(width: int) -> None:
    hashes = [bytes(random.Random(i).getrandbits(8) for _ in range(width)) for i in range(17)]
    want = [fingerprint(x) for x in hashes]
    assert list(fingerprints(hashes, {width})) == want
    c = Chain.of(hashes)
    assert c.fingerprint_bytes() == fingerprints(hashes, {width}).tobytes()
    mixed = [*hashes, b"\x01" * (width + 1)]
    assert list(fingerprints(mixed, {len(x) for x in mixed})) == [fingerprint(x) for x in mixed]
