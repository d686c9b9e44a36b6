"""The directory as the router's source of prefix holders (the only I/O of routing).

`DirectorySource.prompts` asks `LookupBatch` about many candidate prompts at
once (records omitted: routing needs prefix lengths, not addresses), in
chunks of the directory's `lookup_batch_max`, and returns one `Prompt` per
chain in the order given. Reads are local by default (`linearizable=False`):
a stale answer costs a miss or a wasted pull attempt, which the agent's
validation catches.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdir.core.client import DirectoryClient, lookup_request
from kvdir.directory.limits import RequestLimits
from kvdir.routing.policy import Holder, Prompt
from kvdir.v1 import directory_pb2 as pb


def prompt_of(chain_blocks: int, resp: pb.LookupResponse) -> Prompt:
    """A `Prompt` from one lookup answer (per holder node, its prefix from block 0)."""
    holders = {
        m.node_id: Holder(m.node_id, m.prefix_blocks, m.host, frozenset(m.transports))
        for m in resp.matches
    }
    return Prompt(chain_blocks, holders)


class DirectorySource:
    def __init__(
        self,
        client: DirectoryClient,
        ns: pb.Namespace,
        max_nodes: int = 0,
        batch_max: int = RequestLimits().lookup_batch_max,
        linearizable: bool = False,
    ) -> None:
        assert batch_max > 0, batch_max
        self._client = client
        self._ns = ns
        self._max_nodes = max_nodes
        self._batch_max = batch_max
        self._linearizable = linearizable

    def prompts(self, chains: Sequence[Sequence[bytes]]) -> list[Prompt]:
        """One `Prompt` per chain, in order; `LookupBatch` RPCs of at most `batch_max`."""
        out: list[Prompt] = []
        for i in range(0, len(chains), self._batch_max):
            part = chains[i : i + self._batch_max]
            reqs = [lookup_request(self._ns, c, self._max_nodes, omit_records=True) for c in part]
            resp = self._client.lookup_batch(reqs, linearizable=self._linearizable)
            assert len(resp.results) == len(part), (len(resp.results), len(part))
            out.extend(prompt_of(len(c), r) for c, r in zip(part, resp.results, strict=True))
        return out

    def prompt(self, chain: Sequence[bytes]) -> Prompt:
        return self.prompts([chain])[0]
