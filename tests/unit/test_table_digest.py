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


def test_every_field_of_a_record_counts() -> None:
    def one(**kw: object) -> bytes:
        t = Table()
        must_register(t, "a")
        must_register(t, "b")
        args: dict = {"hashes": [b"\x01\x02"], "node": "a", **kw}  # type: ignore[type-arg]
        must_publish(t, args.pop("node"), args.pop("hashes"), **args)
        return t.digest()

    variants = [
        one(),
        one(node="b"),
        one(hashes=[b"\x01\x02\x00"]),  # a trailing zero byte is another hash
        one(hashes=[b"\x01\x03"]),
        one(ns=NS + "-other"),
        one(tier=int(Tier.HOST)),
        one(gen=2),
        one(addr=0x2000),
        one(length=8192),
        one(rkey=8),
    ]
    assert len(set(variants)) == len(variants)


def test_a_namespace_without_records_leaves_no_trace() -> None:
    t = built([1, 2])
    must_publish(t, "a", chain(1, start=50), ns=NS + "-gone")
    t.apply(Remove("a", 1, NS + "-gone", int(Tier.GPU), chain(1, start=50)))
    assert t.digest() == built([1, 2]).digest()
