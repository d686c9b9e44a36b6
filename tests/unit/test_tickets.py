"""Load tickets (agent/tickets.py): what the agent accepts back, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from kvdir.agent.holders import Holder
from kvdir.agent.limits import TICKET_BYTES_MAX, TICKET_HOLDERS_MAX
from kvdir.agent.tickets import BadTicket, StaleTicket, Tickets
from kvdir.v1 import directory_pb2 as pb

NS_KEY = "ns-key"
EPOCH = 7


def holder(node: str = "a", n: int = 4, tiers: bool = True) -> Holder:
    return Holder.of(
        pb.NodeMatch(
            node_id=node,
            prefix_blocks=n,
            host="127.0.0.1",
            agent_endpoint="127.0.0.1:1",
            transports=["tcp"],
            addresses=bytes(8 * n),
            lengths=bytes(4 * n),
            rkeys=bytes(4 * n),
            generations=bytes(8 * n),
            tiers=bytes(n) if tiers else b"",
        )
    )


def test_a_ticket_comes_back_as_issued() -> None:
    t = Tickets()
    got = t.check(t.issue(NS_KEY, EPOCH, [holder("a"), holder("b", 2)]), NS_KEY, EPOCH)
    assert [(m.node_id, m.prefix_blocks) for m in got] == [("a", 4), ("b", 2)]
    assert got[0].generations == bytes(32)


def test_a_ticket_of_another_process_or_damaged_is_refused() -> None:
    data = Tickets().issue(NS_KEY, EPOCH, [holder()])
    with pytest.raises(BadTicket, match="not issued by this agent"):
        Tickets().check(data, NS_KEY, EPOCH)  # another key: the agent restarted
    t = Tickets(key=b"k" * 32)
    good = t.issue(NS_KEY, EPOCH, [holder()])
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 1
    for bad in (bytes(flipped), good[:-1], b"", b"x"):
        with pytest.raises(BadTicket):
            t.check(bad, NS_KEY, EPOCH)


def test_a_ticket_for_another_namespace_is_refused_and_another_epoch_is_stale() -> None:
    t = Tickets()
    data = t.issue(NS_KEY, EPOCH, [holder()])
    with pytest.raises(BadTicket, match="another namespace"):
        t.check(data, "other", EPOCH)
    with pytest.raises(StaleTicket):
        t.check(data, NS_KEY, EPOCH + 1)


def test_bounds_and_malformed_holders_are_refused() -> None:
    t = Tickets()
    with pytest.raises(BadTicket, match="over"):
        t.check(b"\0" * (TICKET_BYTES_MAX + 1), NS_KEY, EPOCH)
    short = dataclasses.replace(holder(), generations=bytes(8 * 3))  # short of the prefix
    for bad, why in (
        (short, "generations"),
        (holder(n=0), "prefix of 0"),
        (Holder("x", 1, "", "", ()), "no endpoint"),
    ):
        with pytest.raises(BadTicket, match=why):
            t.check(t.issue(NS_KEY, EPOCH, [bad]), NS_KEY, EPOCH)
    assert t.check(t.issue(NS_KEY, EPOCH, [holder(tiers=False)]), NS_KEY, EPOCH)
    with pytest.raises(AssertionError):
        t.issue(NS_KEY, EPOCH, [holder()] * (TICKET_HOLDERS_MAX + 1))
