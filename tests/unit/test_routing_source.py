"""DirectorySource against an in-memory stand-in for the client: batching and decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvdir.core.client import DirectoryClient, namespace
from kvdir.routing import Holder
from kvdir.routing.directory_source import DirectorySource
from kvdir.v1 import directory_pb2 as pb


class FakeClient:
    """Answers each lookup with node `a` holding the first block and `b` all of them."""

    def __init__(self) -> None:
        self.batches: list[list[pb.LookupRequest]] = []

    def lookup_batch(
        self, lookups: Sequence[pb.LookupRequest], linearizable: bool = False
    ) -> pb.LookupBatchResponse:
        self.batches.append(list(lookups))
        results = []
        for req in lookups:
            n = len(req.packed_hashes) // req.hash_width
            results.append(
                pb.LookupResponse(
                    matches=[
                        pb.NodeMatch(node_id="b", prefix_blocks=n, host="hb", transports=["tcp"]),
                        pb.NodeMatch(node_id="a", prefix_blocks=1, host="ha", transports=["rdma"]),
                    ]
                )
            )
        return pb.LookupBatchResponse(results=results)


def test_prompts_come_back_in_order_from_bounded_batches() -> None:
    fake = FakeClient()
    ns = namespace("m", 16)
    src = DirectorySource(cast(DirectoryClient, fake), ns, max_nodes=4, batch_max=2)
    chains = [[i.to_bytes(8, "big") for i in range(k + 1)] for k in range(5)]
    prompts = src.prompts(chains)
    assert [len(b) for b in fake.batches] == [2, 2, 1]
    req = fake.batches[0][0]
    assert req.omit_records and req.max_nodes == 4 and req.namespace == ns
    for k, p in enumerate(prompts):
        assert p.chain_blocks == k + 1
        assert p.holders["b"] == Holder("b", k + 1, "hb", frozenset({"tcp"}))
        assert p.holders["a"] == Holder("a", 1, "ha", frozenset({"rdma"}))
    assert src.prompts([]) == []
    assert src.prompt(chains[0]).chain_blocks == 1
