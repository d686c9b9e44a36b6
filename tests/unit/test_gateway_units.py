"""Gateway pieces without sockets: config checks, prompt keys, the pull hint, SGLang hashes."""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvdir.agent.events.hashes import int64_of_digest, key, keys
from kvdir.agent.events.selfcheck import first_block_hashes
from kvdir.agent.pull_hint import HintError, PullHint, parse
from kvdir.core.config import ConfigError
from kvdir.core.hashing import (
    ROOT_SEED,
    HashSchemeError,
    block_chain,
    sglang_keys,
    sglang_page_digests,
)
from kvdir.gateway.chain import chain_fn
from kvdir.gateway.config import ModelConfig, from_dict
from kvdir.gateway.errors import RequestError
from kvdir.gateway.prompt import ModelPrompts

BACKEND = {"url": "http://127.0.0.1:9", "node_id": "n1"}


def test_config_defaults_and_refusals() -> None:
    cfg = from_dict({"backends": [BACKEND], "directory": "a:1, b:2"})
    assert cfg.directory == ("a:1", "b:2") and cfg.policy == "affinity+pool"
    bad: list[tuple[dict[str, Any], str]] = [
        ({}, "at least one"),
        ({"backends": [{**BACKEND, "url": "http://x/v1"}]}, "no path"),
        ({"backends": [BACKEND, BACKEND]}, "unique"),
        ({"backends": [{**BACKEND, "max_concurrency": 0}]}, "max_concurrency"),
        ({"backends": [BACKEND], "listen": "nowhere"}, "HOST:PORT"),
        ({"backends": [BACKEND], "tls_cert": "c.pem"}, "go together"),
        ({"backends": [BACKEND], "retries": -1}, "retries"),
        ({"backends": [BACKEND], "health_interval_s": "x"}, "health_interval_s must be a number"),
        ({"backends": [BACKEND], "balance_rel": True}, "balance_rel must be a number"),
        ({"backends": [BACKEND], "bogus": 1}, "unknown keys: bogus"),
        ({"backends": [BACKEND], "models": [{"name": "m", "shape": "gpt"}]}, "shape"),
        ({"backends": [BACKEND], "models": [{"name": "m", "hash_algo": "md5"}]}, "hash_algo"),
    ]
    for raw, text in bad:
        with pytest.raises(ConfigError, match=text):
            from_dict(raw)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 4, 16]))
def test_vllm_chain_is_what_the_agent_indexes(tokens: list[int], bt: int) -> None:
    """The gateway's keys == the agent's keys of vLLM's BlockStored hashes of the same tokens."""
    got = chain_fn(ModelConfig("m", block_tokens=bt, hash="vllm"))(tokens)
    assert got == keys(first_block_hashes(tokens, bt, "sha256", ""))
    assert len(got) == len(tokens) // bt
    digests = first_block_hashes(tokens, bt, "sha256", "", int_hashes=False)
    full = chain_fn(ModelConfig("m", block_tokens=bt, hash="vllm", hash_bytes=True))(tokens)
    assert full == keys(digests)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=100), st.sampled_from([1, 3, 16]))
def test_sglang_chain_is_what_the_agent_indexes(tokens: list[int], page: int) -> None:
    """SGLang publishes int64(digest[:8]); the agent keys it as those 8 bytes."""
    digests = sglang_page_digests(tokens, page)
    assert len(digests) == len(tokens) // page
    prev = b""
    for i, d in enumerate(digests):  # the page hash written out, as SGLang's hash_page does
        data = b"".join(struct.pack("<I", t) for t in tokens[i * page : (i + 1) * page])
        assert d == hashlib.sha256(prev + data).digest()
        prev = d
    published = [int64_of_digest(d) for d in digests]
    assert [key(h) for h in published] == sglang_keys(digests)
    assert chain_fn(ModelConfig("m", block_tokens=page, hash="sglang"))(tokens) == sglang_keys(
        digests
    )


def test_sglang_refuses_wide_tokens_and_kvdir_scheme_matches_directory() -> None:
    with pytest.raises(HashSchemeError, match=r"0\.\.4294967295"):
        sglang_page_digests([1, 2**32], 2)
    toks = list(range(100))
    assert chain_fn(ModelConfig("m", block_tokens=16, hash="kvdir"))(toks) == block_chain(toks, 16)


def _kvdir_chain_written_out(tokens: list[int], bt: int, seed: int) -> list[bytes]:
    """The kvdir key definition, one block at a time: xxh3-64(parent | u32le block)."""
    out, parent = [], struct.pack(">Q", seed)
    for start in range(0, len(tokens) - bt + 1, bt):
        parent = xxhash.xxh3_64_digest(parent + struct.pack(f"<{bt}I", *tokens[start : start + bt]))
        out.append(parent)
    return out


@pytest.mark.parametrize(
    ("tokens", "bt", "seed", "pinned"),
    [
        (
            list(range(48)),
            16,
            ROOT_SEED,
            ["8cb447191d3a0e04", "6dd413fab60f0694", "7370cbe2f2fdaa7a"],
        ),
        ([0, 1, 2**32 - 1, 31999, 5], 2, ROOT_SEED, ["19c35504daf2c396", "1854f0c9a4234bab"]),
        (list(range(32)), 16, 1, ["c857c5df2612d1d3", "a6bea3e38a43bb71"]),
        ([7] * 3, 4, ROOT_SEED, []),
    ],
)
def test_kvdir_keys_are_pinned(tokens: list[int], bt: int, seed: int, pinned: list[str]) -> None:
    """Engines and agents compute these same keys: a faster block_chain must not move them."""
    assert [h.hex() for h in block_chain(tokens, bt, seed)] == pinned
    assert block_chain(array("I", tokens), bt, seed) == [bytes.fromhex(h) for h in pinned]
    assert _kvdir_chain_written_out(tokens, bt, seed) == block_chain(tokens, bt, seed)


def test_unseeded_xxhash_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        chain_fn(ModelConfig("m", hash="vllm", hash_algo="xxhash"))


def test_prompt_extraction_and_refusals() -> None:
    mp = ModelPrompts(ModelConfig("m"))
    assert list(mp.completion_tokens({"prompt": [5, 6, 7]})) == [5, 6, 7]
    assert list(mp.completion_tokens({"prompt": [[1, 2], [3]]})) == [1, 2]  # batch: the first
    assert mp.chat_tokens({"messages": [{"role": "user", "content": "x"}]}) is None
    for body, text in (
        ({"prompt": [1.5, 2]}, "token ids"),
        ({"prompt": ["7"]}, "token ids"),
        ({"prompt": [2**32]}, "token ids"),
        ({"prompt": "text"}, "no tokenizer"),
        ({"prompt": None}, "required"),
        ({"messages": "hi"}, "messages"),
    ):
        with pytest.raises(RequestError, match=text) as e:
            if "messages" in body:
                mp.chat_tokens(body)
            else:
                mp.completion_tokens(body)
        assert e.value.status == 400
    small = ModelPrompts(ModelConfig("m", max_prompt_tokens=3))
    with pytest.raises(RequestError, match="max_prompt_tokens"):
        small.completion_tokens({"prompt": [1, 2, 3, 4]})


def test_pull_hint_round_trip_and_refusals() -> None:
    h = PullHint("node-a/vllm0/dp0", 12, 240, "rdma")
    assert parse(h.encode()) == h
    for bad in (
        "peer=a; local=1; blocks=2",
        "peer=a; local=1; blocks=2; transport=tcp; peer=b",
        "peer=a; local=-1; blocks=2; transport=tcp",
        "peer=a b; local=1; blocks=2; transport=tcp",
        "peer=a; local=1; blocks=0; transport=tcp",
        "garbage",
    ):
        with pytest.raises(HintError):
            parse(bad)


def test_deploy_example_config_loads() -> None:
    """deploy/config/gateway.toml is a valid configuration (its paths are examples)."""
    from pathlib import Path

    from kvdir.gateway.config import load

    path = Path(__file__).resolve().parents[2] / "deploy" / "config" / "gateway.toml"
    cfg = load(str(path))
    assert len(cfg.backends) == 2 and cfg.models[0].hash == "vllm"
