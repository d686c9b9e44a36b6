"""Block lengths: the directory refuses ones that cannot be a block; readers check every record."""

from __future__ import annotations

import pytest

from kvdir.agent.fetcher import record_slot
from kvdir.directory.limits import RequestLimits
from kvdir.directory.validate import BadRequest, publish
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb


def _request(lengths: list[int]) -> pb.PublishRequest:
    n = len(lengths)
    return pb.PublishRequest(
        node_id="n1",
        incarnation=1,
        namespace=pb.Namespace(model="m", block_tokens=16),
        tier=pb.TIER_GPU,
        block_ids=list(range(1, n + 1)),
        addresses=[4096 * i for i in range(n)],
        lengths=lengths,
        rkeys=[7] * n,
        generations=[1] * n,
    )


@pytest.mark.parametrize(
    ("lengths", "why"),
    [([0], "is 0"), ([4096, 0], "is 0"), ([4096, 8192], "differ")],
)
def test_publish_refuses_lengths_that_cannot_be_a_block(lengths: list[int], why: str) -> None:
    with pytest.raises(BadRequest, match=why) as e:
        publish(_request(lengths), RequestLimits())
    assert e.value.reason == "bad-length"


def test_publish_takes_one_length_for_every_block() -> None:
    assert publish(_request([4096] * 3), RequestLimits()).lengths == [4096] * 3


POOL = apb.PoolInfo(data_address=1 << 20, slot_bytes=4096, slots=8)


@pytest.mark.parametrize(
    ("address", "length", "ok"),
    [
        ((1 << 20) + 4096 * 3, 4096, True),
        ((1 << 20) + 4096 * 7, 4096, True),
        ((1 << 20) + 4096 * 3, 0, False),  # zero bytes
        ((1 << 20) + 4096 * 3, 2048, False),  # part of a slot
        ((1 << 20) + 4096 * 3, 8192, False),  # more than a slot
        ((1 << 20) + 100, 4096, False),  # not slot-aligned
        ((1 << 20) + 4096 * 8, 4096, False),  # past the last slot
        ((1 << 20) - 4096, 4096, False),  # before the pool
    ],
)
def test_a_reader_trusts_only_records_that_are_one_whole_slot(
    address: int, length: int, ok: bool
) -> None:
    slot = record_slot(POOL, address, length, 4096)
    assert (slot >= 0) is ok
    if ok:
        assert slot == (address - POOL.data_address) // 4096


def test_a_reader_refuses_a_holder_whose_slots_differ_from_its_own() -> None:
    assert record_slot(POOL, (1 << 20) + 4096, 4096, 8192) == -1


def test_publish_takes_index_only_records() -> None:
    """Stock engines' caches are published for routing with address, length and
    rkey all 0 (agent/events/holders.py): no bytes to read, so no length to check."""
    req = _request([0, 0, 0])
    req.addresses[:] = [0, 0, 0]
    req.rkeys[:] = [0, 0, 0]
    cmd = publish(req, RequestLimits())
    assert list(cmd.lengths) == [0, 0, 0]
