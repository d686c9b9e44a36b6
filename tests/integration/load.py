"""A publish load for operations tests: what was acknowledged, and whether it is still there.

One background thread publishes block i (hash `h(i, salt)`, address
`address_of(i)`) for one node, one call per block, bounded in count and time,
and records which publishes were acknowledged (committed). `missing_on` asks
one replica which acknowledged blocks it does not show.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdir.core.client import DirectoryClient, DirectoryError, OutcomeUnknown, Unavailable, records
from kvdir.local import Replica
from kvdir.v1 import directory_pb2 as pb
from tests.integration.helpers import address_of, h, publish

LOOKUP_BATCH = 256


@dataclass
class Load:
    addresses: Sequence[str]
    node: str
    space: pb.Namespace
    salt: int
    publishes_max: int = 20_000
    seconds_max: float = 90.0
    acked: list[tuple[int, float]] = field(default_factory=list)
    """(block number, monotonic time of the acknowledgement)."""
    not_acked: int = 0
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._run, name=f"load-{self.node}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds_max
        try:
            with DirectoryClient(self.addresses, timeout_s=3.0, retry_unknown=False) as c:
                for i in range(self.publishes_max):
                    if self.stop.is_set() or time.monotonic() >= deadline:
                        return
                    try:
                        publish(c, self.node, 1, self.space, [h(i, self.salt)], first=i)
                    except (OutcomeUnknown, Unavailable):
                        self.not_acked += 1
                    except DirectoryError as e:  # refused: a bug, not an operations effect
                        self.errors.append(e)
                        return
                    else:
                        self.acked.append((i, time.monotonic()))
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.done.set()

    def acked_after(self, t: float) -> int:
        return sum(1 for _, at in list(self.acked) if at > t)

    def wait_acked_after(self, t: float, n: int, timeout_s: float, what: str) -> None:
        from kvdir.local import wait_for

        wait_for(lambda: self.acked_after(t) >= n or self.done.is_set(), timeout_s, what)
        assert not self.errors, self.errors
        assert self.acked_after(t) >= n, f"{what}: load stopped ({self.not_acked} not acked)"

    def finish(self) -> list[int]:
        """Stop; the acknowledged block numbers."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive()
        assert not self.errors, self.errors
        return [i for i, _ in self.acked]

    def longest_gap_s(self, since: float = 0.0) -> float:
        times = [t for _, t in self.acked if t >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def missing_on(
    c: DirectoryClient,
    r: Replica,
    load: Load,
    blocks: Sequence[int],
    linearizable: bool = False,
) -> list[int]:
    """Blocks of `blocks` replica `r` does not show as held by the load's node."""
    missing: list[int] = []
    for start in range(0, len(blocks), LOOKUP_BATCH):
        part = blocks[start : start + LOOKUP_BATCH]
        lookups = [
            pb.LookupRequest(namespace=load.space, block_hashes=[h(i, load.salt)]) for i in part
        ]
        resp = c.lookup_batch(lookups, linearizable=linearizable, address=r.grpc_address)
        assert resp.read.replica_id == r.replica_id
        for i, res in zip(part, resp.results, strict=True):
            got = [(m.node_id, m.prefix_blocks, records(m).addresses) for m in res.matches]
            if got != [(load.node, 1, [address_of(i)])]:
                missing.append(i)
    return missing


def kvdir(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the `kvdir` CLI (this checkout's) and return its result; never raises on failure."""
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def kvdir_ok(*args: str, timeout_s: float = 60.0) -> str:
    res = kvdir(*args, timeout_s=timeout_s)
    assert res.returncode == 0, f"kvdir {' '.join(args)} failed: {res.stderr.strip()}"
    return res.stdout
