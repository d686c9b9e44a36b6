"""PeerCache keeps one channel per peer and never drops one open.

The handshake is a gRPC round trip to the peer's agent; here it is replaced by
a function that hands out channels which record their close (a test double:
what is under test is the cache's bookkeeping when fetches race, which a real
handshake can only hit by timing). A channel dropped open is a socket that
leaks until the garbage collector finds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from kvdir.agent.fetcher import Peer, PeerCache
from kvdir.transfer.base import Channel, Read, TransferError
from kvdir.transfer.engine import TransferEngine

WAIT_S = 10.0


class _Channel(Channel):
    def __init__(self) -> None:
        self.closes = 0

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        raise AssertionError("not read in these tests")

    def close(self) -> None:
        self.closes += 1


class _Cache(PeerCache):
    """Handshakes meet at `gate` (when set) and wait for `release`."""

    def __init__(self, engine: TransferEngine, gate: threading.Barrier | None = None) -> None:
        super().__init__(engine, "reader")
        self.gate = gate
        self.handshook: list[_Channel] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def _handshake(self, node_id: str, endpoint: str) -> Peer:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(WAIT_S)
        assert self.release.wait(WAIT_S)
        ch = _Channel()
        self.handshook.append(ch)
        return Peer(node_id, 1, True, {}, "double", ch)


class _Get(threading.Thread):
    """One `cache.get` in its own thread; what it returned or raised."""

    def __init__(self, fn: Callable[[], Peer]) -> None:
        super().__init__()
        self.fn = fn
        self.result: Peer | Exception | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:  # the test checks what came back
            self.result = e

    def finish(self) -> Peer | Exception | None:
        self.join(WAIT_S)
        assert not self.is_alive()
        return self.result


@pytest.fixture
def engine() -> TransferEngine:
    return TransferEngine([])  # no backend: the handshakes here open no channels


def test_racing_handshakes_keep_one_peer_and_close_the_others(engine: TransferEngine) -> None:
    n = 4
    cache = _Cache(engine, threading.Barrier(n))
    try:
        gets = [_Get(lambda: cache.get("holder", "ep")) for _ in range(n)]
        for g in gets:
            g.start()
        got = [g.finish() for g in gets]
        kept = got[0]
        assert isinstance(kept, Peer)
        assert all(p is kept for p in got)  # every fetch got the stored peer
        assert len(cache.handshook) == n  # the barrier made them all handshake
        losers = [ch.closes for ch in cache.handshook if ch is not kept.channel]
        assert losers == [1] * (n - 1)
        assert isinstance(kept.channel, _Channel) and kept.channel.closes == 0
        assert list(cache.peers) == [("holder", "ep")]
        assert cache.get("holder", "ep") is kept  # later gets reuse it
        assert len(cache.handshook) == n
    finally:
        cache.close()
        engine.close()
    assert all(ch.closes == 1 for ch in cache.handshook)


def test_a_handshake_that_ends_after_close_is_closed_not_cached(engine: TransferEngine) -> None:
    cache = _Cache(engine)
    cache.release.clear()
    try:
        pending = _Get(lambda: cache.get("holder", "ep"))
        pending.start()
        assert cache.entered.wait(WAIT_S)
        cache.close()  # the agent stops while the fetch is still handshaking
        cache.release.set()
        err = pending.finish()
        assert isinstance(err, TransferError) and "stopping" in str(err)
        (ch,) = cache.handshook
        assert ch.closes == 1
        assert cache.peers == {}
        with pytest.raises(TransferError, match="stopping"):
            cache.get("other", "ep2")
        assert [c.closes for c in cache.handshook] == [1, 1]
    finally:
        engine.close()
