"""`Table.digest`: equal for equal content however it was built, different otherwise."""

from __future__ import annotations

from pathlib import Path

from kvdir.directory.commands import ExpireNodes, Remove, Tier
from kvdir.directory.table import Table

from .helpers import NS, chain, must_publish, must_register, restored


def built(order: list[int]) -> Table:
    t = Table()
    must_register(t, "a")
    must_register(t, "b")
    for i in order:
        must_publish(t, "a" if i % 2 else "b", chain(1, start=i), gen=i + 1, addr=0x1000 * i)
    return t


def test_same_content_same_digest_whatever_the_order() -> None:
    assert built([1, 2, 3, 4]).digest() == built([4, 3, 2, 1]).digest()


def test_digest_survives_a_snapshot_round_trip(tmp_path: Path) -> None:
    t = built([1, 2, 3, 4, 5])
    t.apply(Remove("a", 1, NS, int(Tier.GPU), chain(1, start=3)))
    assert restored(t, tmp_path / "snap.bin").digest() == t.digest()


def test_any_change_changes_the_digest() -> None:
    base = built([1, 2, 3]).digest()
    t = built([1, 2, 3])
    must_publish(t, "a", chain(1, start=1), gen=9, addr=0x1000)  # a newer generation only
    assert t.digest() != base
    t2 = built([1, 2, 3])
    t2.apply(ExpireNodes(10**12, (("b", 1),)))  # a node and its entries gone
    assert t2.digest() not in (base, t.digest())
    assert Table().digest() != base
