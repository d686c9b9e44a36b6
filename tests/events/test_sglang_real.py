"""SGLang's REAL KV-event publisher and event recorder -> the agent -> the directory.

SGLang 0.5.23's own `ZmqEventPublisher` (built by `EventPublisherFactory` from a
`--kv-events-config` JSON), its `KVCacheEventRecorder` and its native SHA-256
page hashes run in a subprocess (tests/events/sglang_driver.py) from the files
of its wheel (scripts/install-sglang.sh). SGLang 0.5.23 sends tagged maps, the
batch `[ts, events, attn_dp_rank]`, int64 hashes of the first 8 digest bytes,
and replay replies with a topic frame.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdir.agent.config import EngineConfig
from kvdir.agent.events.hashes import keys
from kvdir.agent.events.ingest import EngineIngest
from kvdir.agent.publisher import NodeIdentity, PublisherLimits
from kvdir.core.client import DirectoryClient
from kvdir.local import LOOPBACK, ClusterError, free_ports
from tests.events.helpers import VllmEngine, tokens, vllm_home, wait_prefix, wait_subscribed

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SGLANG_VERSION = "0.5.23"
DRIVER = Path(__file__).with_name("sglang_driver.py")
PAGE = 16
MODEL = "events-sglang"
START_S = 60.0


def sglang_home() -> Path:
    """The install's DEST; skipped (failed under CI) when it is not installed."""
    home = vllm_home() / f"sglang-{SGLANG_VERSION}"
    if not (home / "bin" / "python").exists():
        why = f"SGLang {SGLANG_VERSION} is not installed: run scripts/install-sglang.sh"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return home


class SglangEngine(VllmEngine):
    """SGLang's publisher + recorder in a subprocess; VllmEngine's JSON-lines protocol."""

    def __init__(self, home: Path, endpoint: str, replay_endpoint: str, log_path: str) -> None:
        cmd = [
            str(home / "bin" / "python"),
            str(DRIVER),
            "--home",
            str(home),
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay_endpoint,
            "--page-size",
            str(PAGE),
        ]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        if not self._read(START_S).get("ready"):
            raise ClusterError("SGLang driver did not start")

    def store(self, rid: str, tokens: Sequence[int], **kw: Any) -> list[Any]:
        stored: list[Any] = self.put(rid, tokens, **kw)["stored"]
        return stored

    def __enter__(self) -> SglangEngine:
        return self

    def put(self, node: str, toks: Sequence[int], **kw: Any) -> dict[str, Any]:
        return self.call("store", node=node, tokens=list(toks), **kw)


def _ingest(directory: DirectoryClient, node: str, endpoint: str, replay: str) -> EngineIngest:
    cfg = EngineConfig(
        name="sglang",
        kind="sglang",
        endpoint=endpoint,
        replay_endpoint=replay,
        bind=not endpoint.startswith("ipc://"),
        model=MODEL,
        block_tokens=PAGE,
        hash_format="signed",
    )
    ident = NodeIdentity(node, LOOPBACK, "", (), 15_000)
    ing = EngineIngest(cfg, directory, ident, PublisherLimits(batch_window_s=0.002))
    ing.start()
    return ing


def _first8(digests: list[str]) -> list[bytes]:
    """SGLang's hash form: the int64 of a page digest's first 8 bytes."""
    return [bytes.fromhex(d)[:8] for d in digests]


@pytest.mark.timeout(120)
def test_stores_removals_gap_and_clear(directory: DirectoryClient, tmp_path: Path) -> None:
    """tcp, the engine connects (we bind): a radix node and its child stored, evicted,
    a message lost on the wire recovered through replay, AllBlocksCleared."""
    home = sglang_home()
    pub, rep = free_ports(2)
    node, holder = "sgl-real", "sgl-real/sglang/dp0"
    ep, rp = f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{rep}"
    ing = _ingest(directory, node, ep, rp)
    try:
        with SglangEngine(home, ep, rp, str(tmp_path / "sglang.log")) as eng:
            ns = ing.cfg.namespace()
            c = ing.consumers[0]
            wait_subscribed(eng, lambda: c.stats.messages)
            # 1. a node of 20 pages: one coalesced BlockStored of signed int64 hashes.
            r1 = eng.put("n1", tokens(1, 20))
            assert r1["types"] == ["BlockStored"] and len(r1["stored"]) == 20
            assert any(h < 0 for h in r1["stored"]), "want a negative int64 on the wire"
            chain = keys(r1["stored"])
            assert chain == _first8(r1["digests"])
            wait_prefix(directory, ns, chain, holder, 20)
            # 2. a child node continues the chain (parent link = n1's last page).
            r2 = eng.put("n2", tokens(2, 5), parent="n1")
            child = keys(r2["stored"])
            assert child == _first8(r2["digests"])
            wait_prefix(directory, ns, chain + child, holder, 25)
            # 3. evictions: the child, then the node.
            assert keys(eng.call("remove", node="n2")["removed"]) == child
            wait_prefix(directory, ns, chain + child, holder, 20)
            assert keys(eng.call("remove", node="n1")["removed"]) == chain
            wait_prefix(directory, ns, chain, holder, 0)
            # 4. a message lost on the wire: the next one reveals the gap, replay fills it.
            eng.call("drop_next")
            lost = keys(eng.store("n3", tokens(3, 3)))
            later = keys(eng.store("n4", tokens(4, 2)))
            wait_prefix(directory, ns, later, holder, 2)
            wait_prefix(directory, ns, lost, holder, 3)
            assert c.stats.gaps >= 1 and c.stats.replayed_batches >= 1
            assert c.stats.gaps_unrecovered == 0
            # 5. a reset: AllBlocksCleared withdraws everything the holder had.
            assert eng.call("clear")["events"] == ["AllBlocksCleared"]
            wait_prefix(directory, ns, later, holder, 0)
            wait_prefix(directory, ns, lost, holder, 0)
            assert c.stats.clears == 1 and c.stats.decode_errors == 0
    finally:
        ing.stop()


@pytest.mark.timeout(120)
def test_late_subscriber_and_medium_over_ipc(directory: DirectoryClient, tmp_path: Path) -> None:
    """ipc, the engine binds: a batch sent before we subscribed comes back through
    replay; a DISK store goes to its own holder, CPU_PINNED to the host tier."""
    home = sglang_home()
    ep, rp = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    node, holder = "sgl-ipc", "sgl-ipc/sglang/dp0"
    ing = None
    with SglangEngine(home, ep, rp, str(tmp_path / "sglang.log")) as eng:
        try:
            early = keys(eng.store("e1", tokens(10, 4)))
            ing = _ingest(directory, node, ep, rp)
            ns = ing.cfg.namespace()
            c = ing.consumers[0]
            wait_subscribed(eng, lambda: c.stats.messages)
            wait_prefix(directory, ns, early, holder, 4)
            assert c.stats.replayed_batches >= 1
            disk = keys(eng.store("d1", tokens(11, 2), medium="DISK"))
            wait_prefix(directory, ns, disk, f"{holder}/disk", 2)
            host = keys(eng.store("h1", tokens(12, 3), medium="CPU_PINNED"))
            wait_prefix(directory, ns, host, holder, 3)
            eng.call("remove", node="d1", medium="DISK")
            wait_prefix(directory, ns, disk, f"{holder}/disk", 0)
            assert c.stats.decode_errors == 0 and c.stats.gaps_unrecovered == 0
        finally:
            if ing is not None:
                ing.stop()
