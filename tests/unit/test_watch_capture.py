"""Watch starts share one capture while it is in use and fresh (directory/watch.py `_capture`).

A capture costs the consensus thread O(nodes) and its copy of the columns
costs the stream's thread O(table): a burst of mirrors starting together
must cost one of each, and a copy must not be kept alive after its last user.
"""

from __future__ import annotations

import gc
import threading

from kvdir.core.mirror import Mirror
from kvdir.directory.commands import Publish, RegisterNode
from kvdir.directory.consensus.port import Capture
from kvdir.directory.limits import WatchLimits
from tests.unit.watch_helpers import LocalReplica, connect


def _loaded(limits: WatchLimits | None = None) -> tuple[LocalReplica, list[int]]:
    r = LocalReplica(limits)
    r.write(RegisterNode("n1", "h", "e", ("tcp",), 1, 60_000, 0))
    hs = [i.to_bytes(8, "big") for i in range(200)]
    r.write(Publish("n1", 1, "ns", 1, hs, [7] * 200, [1] * 200, [2] * 200, [1] * 200))
    calls: list[int] = []
    real = r.consensus.capture

    def counted(timeout_s: float) -> Capture:
        calls.append(1)
        return real(timeout_s)

    r.consensus.capture = counted  # type: ignore[method-assign]  # counts calls to the real one
    return r, calls


def test_a_capture_in_use_is_shared_and_freed_after() -> None:
    r, calls = _loaded()
    first = r.service._capture()
    second = r.service._capture()
    assert second is first and len(calls) == 1
    del first, second
    gc.collect()
    r.service._capture()
    assert len(calls) == 2, "a capture nobody holds any more is not kept"


def test_an_old_capture_is_not_shared() -> None:
    r, calls = _loaded(WatchLimits(snapshot_share_ms=0))
    first = r.service._capture()
    assert r.service._capture() is not first and len(calls) == 2


def test_concurrent_starts_each_get_the_whole_table() -> None:
    r, calls = _loaded()
    mirrors = [Mirror() for _ in range(4)]
    go = threading.Barrier(len(mirrors))

    def start(m: Mirror) -> None:
        go.wait()
        connect(r, m).drain()

    threads = [threading.Thread(target=start, args=(m,)) for m in mirrors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert 1 <= len(calls) <= len(mirrors)
    want = r.table.digest()
    assert [m.table.digest() for m in mirrors] == [want] * len(mirrors)
