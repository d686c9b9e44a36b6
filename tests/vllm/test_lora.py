"""Two LoRA adapters never share a block through kvdir (issue 15).

vLLM puts the LoRA adapter's name into the extra keys of every block hash, and
the connector's keys are those hashes, so a prefix computed under adapter "a"
is invisible to a request for the same tokens under adapter "b". Two real vLLM
CPU engines with `enable_lora=True` on two kvdir agents, serving two adapters
the test writes itself (random weights, B matrices not zero, so the adapters
really compute different KV):

- A computes P under "a";
- B asks for P under "b": vLLM reports no external hit, the connector loads
  nothing, and the answer equals B recomputing P under "b";
- B asks for P under "a": it loads all of P's full blocks from A, and the
  answer equals A computing P under "a".

"Recomputing" means the same engine with a fresh cache_salt, which matches no
block and changes only the hashes, never the computation. The engines and agents
are the session's `pair` (conftest.py: node B's agent moves blocks over TCP),
shared with test_e2e; counters are read as differences.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvdir.core.hashing import vllm_hash_fn, vllm_none_hash
from kvdir.local import ClusterError, LocalCluster, wait_agent_sees, wait_for
from tests.vllm.conftest import LORAS, Pair
from tests.vllm.engines import Engine
from tests.vllm.helpers import NS, WAIT_S, metric, prompt
from tests.vllm.model import BLOCK_TOKENS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_TOKENS = 336
"""10 full blocks and a partial one: vLLM always computes a prompt's last token itself,
so a prompt of whole blocks would load one block less."""
OUT_TOKENS = 8
LOGPROB_TOL = 0.05
"""bf16 KV: a loaded prefix and a recomputed one may differ in the last bits."""
EXTERNAL = "vllm:external_prefix_cache_hits"
LOADED = "kvdir:loaded_blocks_total"
LOOKUPS = "kvdir:lookups_total"
BLOCKS = PROMPT_TOKENS // BLOCK_TOKENS
FULL = BLOCKS * BLOCK_TOKENS


def out(engine: Engine, tokens: list[int], lora: str, salt: str | None = None) -> dict[str, Any]:
    ans = engine.generate(
        [tokens], max_tokens=OUT_TOKENS, logprobs=True, lora=[lora, LORAS[lora]], cache_salt=salt
    )
    return dict(ans["outputs"][0])


def same_answer(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["tokens"] == ref["tokens"]
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], ref["logprobs"], strict=True)]
    assert max(diffs) <= LOGPROB_TOL, max(diffs)


def lora_keys(tokens: list[int], name: str, path: str) -> list[bytes]:
    """vLLM's sha256 block hashes of `tokens` under adapter `name`: every block
    carries ("lora", name, path) as its extra key (kv_cache_utils, 0.32)."""
    fn = vllm_hash_fn("sha256")
    extra = (("lora", name, path),)
    parent = vllm_none_hash("sha256")
    out = []
    for i in range(len(tokens) // BLOCK_TOKENS):
        block = tuple(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
        parent = fn((parent, block, extra))
        out.append(parent)
    return out


def holders(cluster: LocalCluster, keys: list[bytes]) -> dict[str, int]:
    with cluster.client(timeout_s=5) as c:
        resp = c.lookup(NS, keys)
    return {m.node_id: m.prefix_blocks for m in resp.matches}


def wait_holds(cluster: LocalCluster, keys: list[bytes], node: str) -> None:
    seen: list[dict[str, int]] = [{}]

    def enough() -> bool:
        seen[0] = holders(cluster, keys)
        return seen[0].get(node, 0) >= len(keys)

    try:
        wait_for(enough, WAIT_S, f"{node} to hold {len(keys)} blocks", 0.05)
    except ClusterError as e:
        raise ClusterError(f"{e} (the directory said {seen[0]})") from None


def counters(engine: Engine) -> tuple[float, float, float]:
    """(vLLM's external prefix hits in tokens, the connector's loaded blocks, its lookups)."""
    m = engine.metrics()
    return metric(m, EXTERNAL), metric(m, LOADED), metric(m, LOOKUPS)


@pytest.mark.timeout(1500)
def test_two_lora_names_never_share_a_block(pair: Pair) -> None:
    a, b = pair.engines["a"], pair.engines["b"]
    p = prompt(61, PROMPT_TOKENS)
    under_a = lora_keys(p, "a", f"{pair.lora_dir}/a")
    under_b = lora_keys(p, "b", f"{pair.lora_dir}/b")
    assert not set(under_a) & set(under_b)

    assert out(a, p, "a")["cached"] == 0
    wait_holds(pair.cluster, under_a, "a")  # A's blocks are published under "a"
    assert holders(pair.cluster, under_b) == {}

    ext0, loaded0, lookups0 = counters(b)
    other = out(b, p, "b")
    ext1, loaded1, lookups1 = counters(b)
    assert lookups1 > lookups0  # the connector did ask kvdir...
    assert other["cached"] == 0
    assert (ext1, loaded1) == (ext0, loaded0)  # ...and nothing came from it
    same_answer(other, out(b, p, "b", salt="ref-b"))

    ref_a = out(a, p, "a", salt="ref-a")
    assert ref_a["cached"] == 0
    # The adapters really compute differently. Greedy tokens, not logprobs: with
    # dummy base weights every logit is ~0, so each sampled logprob is ~log(1/vocab).
    assert ref_a["tokens"] != other["tokens"]

    ext1, loaded1, _ = counters(b)
    wait_agent_sees(pair.daemon_b.cfg.engine_socket, NS, under_a, "a", BLOCKS)  # its mirror
    same = out(b, p, "a")
    ext2, loaded2, _ = counters(b)
    assert same["cached"] == FULL
    assert ext2 - ext1 >= FULL
    assert loaded2 - loaded1 >= BLOCKS
    same_answer(same, ref_a)
