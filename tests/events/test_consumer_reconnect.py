"""An engine that restarts while ZMQ drops its first messages is still caught.

A real ZMQ publisher and replay socket in this process speak vLLM's wire
format (``[topic, seq, payload]`` live, ``[seq, payload]`` replayed, -1 to
end); the consumer is the agent's own `RankConsumer` over real sockets. Only
the index it applies to is a recorder standing in for `IndexHolders` (which
would need a directory): the test is about which batches reach it and when
the old engine's entries are withdrawn.

The case: the old engine's last batch we applied was number N-1; the new
engine's batches 0..N-1 are lost to the slow joiner, so the first one we see
is number N, exactly the one we expect. Only the reconnect tells us to ask
the replay socket whether batch N-1 is still the one we applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvdir.agent.events.consumer import RankConsumer
from kvdir.agent.events.decode import Batch
from kvdir.agent.events.holders import Applied, IndexHolders
from kvdir.local import wait_for

pytestmark = pytest.mark.timeout(60)


def payload(tag: int) -> bytes:
    """One batch storing one block whose hash names the engine and batch."""
    out: bytes = msgpack.packb(
        [time.time(), [["BlockStored", [tag], None, list(range(16)), 16, None]]],
        use_bin_type=True,
    )
    return out


@dataclass
class Recorder:
    """Stands in for IndexHolders: records applied block hashes and clears."""

    engine: str = "vllm"
    applied: list[int] = field(default_factory=list)
    clears: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, rank: int, batch: Batch, generation: int) -> Applied:
        with self.lock:
            for ev in batch.events:
                self.applied.extend(int(h) for h in getattr(ev, "hashes", []))
        return Applied()

    def clear(self, rank: int, generation: int) -> int:
        with self.lock:
            self.clears += 1
            self.applied.clear()
        return 0


class Engine:
    """A publisher with a replay buffer, like vLLM's ZmqEventPublisher."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], pub: str, rep: str, base: int):
        self.base = base  # hashes base + seq tell the engines apart
        self.sent: dict[int, bytes] = {}
        # XPUB, not PUB: it tells us when the consumer's subscription has arrived,
        # so the test decides exactly which batches the consumer sees.
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(pub)
        self.rep = ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.rep.bind(rep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        if not self.pub.poll(int(timeout_s * 1000)):
            raise AssertionError("the consumer never subscribed")
        assert self.pub.recv().startswith(b"\x01")  # a subscribe message

    def batch(self, seq: int, publish: bool = True) -> None:
        """Record batch `seq`; publish it live unless it is one ZMQ dropped."""
        body = payload(self.base + seq)
        self.sent[seq] = body
        if publish:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), body])

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.rep.poll(50):
                continue
            ident, _, start = self.rep.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in self.sent if s >= first):
                self.rep.send_multipart([ident, b"", seq.to_bytes(8, "big"), self.sent[seq]])
            self.rep.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.rep.close(0)


@pytest.fixture
def ends(tmp_path: Path) -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], str, str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep"
    finally:
        ctx.term()


@pytest.mark.parametrize("same_engine", [False, True])
def test_a_restart_landing_on_the_expected_number_is_caught(
    ends: tuple[zmq.Context[zmq.Socket[bytes]], str, str], same_engine: bool
) -> None:
    ctx, pub, rep = ends
    rec = Recorder()
    consumer = RankConsumer(cast(IndexHolders, rec), 0, pub, rep, replay_timeout_s=2.0, context=ctx)
    old = Engine(ctx, pub, rep, base=1000)
    consumer.start()
    try:
        old.wait_subscribed()
        for seq in (0, 1, 2):
            old.batch(seq)
        wait_for(lambda: rec.applied == [1000, 1001, 1002], 10.0, "the old stream applied")
        assert consumer.seq.expected == 3
        old.close()
        # A new engine (or the same one, reconnecting) whose numbers 0..2 never reached us.
        new = Engine(ctx, pub, rep, base=1000 if same_engine else 2000)
        if same_engine:
            new.sent = dict(old.sent)  # the same engine still holds its buffer
        else:
            for seq in (0, 1, 2):
                new.batch(seq, publish=False)  # dropped by the slow joiner
        try:
            new.wait_subscribed()
            new.batch(3)  # lands exactly on the number we expect
            # A new engine: withdrawn, its stream replayed from its start, then batch 3.
            want = [1000, 1001, 1002, 1003] if same_engine else [2000, 2001, 2002, 2003]
            wait_for(lambda: rec.applied == want, 10.0, f"applied == {want}")
            assert rec.clears == (0 if same_engine else 1)
            assert consumer.stats.restarts == (0 if same_engine else 1)
        finally:
            new.close()
    finally:
        consumer.stop()
