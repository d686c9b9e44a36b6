"""vLLM's REAL publisher and BlockPool -> the agent's consumer -> the directory.

Each test runs vLLM (0.33: tagged maps with a topic frame in replay replies;
0.23: positional arrays, replay without topic) in its own venv, drives its
prefix cache, and asserts what the real 3-replica directory holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdir.agent.config import EngineConfig
from kvdir.agent.events.hashes import keys
from kvdir.agent.events.ingest import EngineIngest
from kvdir.agent.events.selfcheck import block_digests
from kvdir.agent.publisher import NodeIdentity, PublisherLimits
from kvdir.core.client import DirectoryClient
from kvdir.local import LOOPBACK, free_ports, wait_for
from tests.events.helpers import (
    VLLM_VERSIONS,
    WAIT_S,
    VllmEngine,
    prefix,
    published_hashes,
    tokens,
    vllm_python,
    wait_prefix,
    wait_subscribed,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BS = 16
MODEL = "events-real"
SEED = "1234"
"""PYTHONHASHSEED of the engine: vLLM <= 0.23 draws a random NONE_HASH without it."""


def _ingest(
    directory: DirectoryClient,
    node: str,
    endpoint: str,
    replay: str,
    bind: bool,
    hash_algo: str = "sha256",
    hash_seed: str = "",
) -> EngineIngest:
    cfg = EngineConfig(
        name="vllm",
        endpoint=endpoint,
        replay_endpoint=replay,
        bind=bind,
        model=MODEL,
        block_tokens=BS,
        hash_algo=hash_algo,
        hash_seed=hash_seed,
    )
    ident = NodeIdentity(node, LOOPBACK, "", (), 15_000)
    ing = EngineIngest(cfg, directory, ident, PublisherLimits(batch_window_s=0.002))
    ing.start()
    return ing


@pytest.fixture
def ipc_endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_stores_removals_gap_and_clear(
    version: str, directory: DirectoryClient, tmp_path: Path
) -> None:
    """u64 hashes over tcp (the engine connects, we bind): store, evict, a dropped
    message recovered through replay, AllBlocksCleared."""
    py = vllm_python(version)
    pub, rep = free_ports(2)
    node = f"real-{version}"
    holder = f"{node}/vllm/dp0"
    ep, rp = f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{rep}"
    ing = _ingest(directory, node, ep, rp, bind=True, hash_seed=SEED)
    log = str(tmp_path / "vllm.log")
    try:
        with VllmEngine(py, ep, rp, log, hash_seed=SEED) as eng:
            ns = ing.cfg.namespace()
            c = ing.consumers[0]
            wait_subscribed(eng, lambda: c.stats.messages)
            # 1. a prefill of 20 blocks: stored, keyed by the low 64 bits of sha256.
            toks = tokens(1, 20)
            raw = published_hashes(eng.store("r1", toks))
            assert all(isinstance(h, int) for h in raw) and len(raw) == 20
            assert any(int(h) >= 1 << 63 for h in raw), "want a uint64 >= 2^63 on the wire"
            chain = keys(raw)
            assert chain == [d[-8:] for d in block_digests(toks, BS, "sha256", SEED)]
            wait_prefix(directory, ns, chain, holder, 20)
            # 2. evictions: vLLM frees the request and reuses the cached blocks.
            eng.call("free", rid="r1")
            removed = published_hashes(eng.call("evict", blocks=-1)["removed"])
            assert removed, "evicting every free block removes cached ones"
            wait_prefix(directory, ns, chain, holder, 0)
            # 3. a message lost on the wire: the next one reveals the gap, replay fills it.
            eng.call("drop_next")
            lost = keys(published_hashes(eng.store("r2", tokens(2, 3))))
            later = keys(published_hashes(eng.store("r3", tokens(3, 2))))
            wait_prefix(directory, ns, later, holder, 2)
            wait_prefix(directory, ns, lost, holder, 3)
            assert c.stats.gaps >= 1 and c.stats.replayed_batches >= 1
            assert c.stats.gaps_unrecovered == 0
            # 4. reset_prefix_cache -> AllBlocksCleared: the holder withdraws everything.
            assert eng.call("clear")["events"] == ["AllBlocksCleared"]
            wait_prefix(directory, ns, later, holder, 0)
            wait_prefix(directory, ns, lost, holder, 0)
            assert c.stats.clears == 1 and c.stats.decode_errors == 0
            assert ing.selftest is not None and ing.selftest.stats.failed == 0
            assert ing.selftest.stats.passed >= 1
    finally:
        ing.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("version", VLLM_VERSIONS[:1])
def test_bytes_hashes_late_subscriber_and_restart(
    version: str, directory: DirectoryClient, ipc_endpoints: tuple[str, str], tmp_path: Path
) -> None:
    """32-byte hashes over ipc (the engine binds): batches sent before we subscribed
    come back through replay; an engine restart (seq back to 0) withdraws its entries."""
    py = vllm_python(version)
    pub, rep = ipc_endpoints
    node = f"bytes-{version}"
    holder = f"{node}/vllm/dp0"
    log = str(tmp_path / "vllm.log")
    eng = VllmEngine(py, pub, rep, log, int_hashes=False)
    ing = None
    try:
        toks = tokens(10, 4)
        early = published_hashes(eng.store("e1", toks))
        assert all(isinstance(h, bytes) and len(h) == 32 for h in early)
        assert early == block_digests(toks, BS, "sha256")
        ing = _ingest(directory, node, pub, rep, bind=False)
        ns = ing.cfg.namespace()
        c = ing.consumers[0]
        # The subscription is up once a message gets through; the early batch is replayed.
        wait_subscribed(eng, lambda: c.stats.messages)
        more = keys(published_hashes(eng.store("e2", tokens(11, 2))))
        chain = keys(early)
        wait_prefix(directory, ns, chain, holder, 4)
        wait_prefix(directory, ns, more, holder, 2)
        assert c.stats.replayed_batches >= 1
        eng.close()
        eng = VllmEngine(py, pub, rep, log, int_hashes=False)
        base = c.stats.messages
        wait_subscribed(eng, lambda: c.stats.messages - base)
        fresh = keys(published_hashes(eng.store("f1", tokens(12, 2))))
        wait_prefix(directory, ns, fresh, holder, 2)
        wait_prefix(directory, ns, chain, holder, 0)
        assert c.stats.restarts == 1
    finally:
        eng.close()
        if ing is not None:
            ing.stop()


@pytest.mark.timeout(240)
def test_hash_selftest_reports_a_mismatch(directory: DirectoryClient, tmp_path: Path) -> None:
    """The agent thinks sha256_cbor; the engine runs sha256: reported, and diagnosed."""
    py = vllm_python(VLLM_VERSIONS[0])
    pub, rep = free_ports(2)
    ing = _ingest(
        directory,
        "selftest",
        f"tcp://{LOOPBACK}:{pub}",
        f"tcp://{LOOPBACK}:{rep}",
        bind=True,
        hash_algo="sha256_cbor",
    )
    try:
        with VllmEngine(
            py, f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{rep}", str(tmp_path / "v.log")
        ) as eng:
            wait_subscribed(eng, lambda: ing.consumers[0].stats.messages)
            chain = keys(published_hashes(eng.store("s1", tokens(20, 2))))
            wait_prefix(directory, ing.cfg.namespace(), chain, "selftest/vllm/dp0", 2)
            st = ing.selftest
            assert st is not None
            wait_for(lambda: st.stats.failed >= 1, WAIT_S, "the self-test to fail")
            assert "They match sha256 " in st.stats.last_message
            assert prefix(directory, ing.cfg.namespace(), chain, "selftest/vllm/dp0") == 2
    finally:
        ing.stop()
