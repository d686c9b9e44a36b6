"""A Publish bigger than one Raft append chunk reaches every replica cleanly.

pysyncobj sends a log entry of `appendEntriesBatchSizeBytes` (64 KiB) or more
in chunks of its pickled form, but used to flag the last chunk by the raw
command's length: a follower received premature "finish" chunks, failed to
unpickle them and aborted that Raft tick with a traceback ("failed _onTick").
The entry arrived anyway, by accident, with the real last chunk, so this test
checks the replicas' logs as well as their tables.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvdir.local import LocalCluster
from tests.integration.helpers import live, ns, publish, register, wait_local_prefixes

pytestmark = pytest.mark.integration

BLOCKS = 4000
"""With 32-byte hashes about 290 KB of command, 420 KB pickled: seven chunks, of
which the old framing flagged three as the last."""


def random_chain(n: int) -> list[bytes]:
    """32-byte hashes that look like real ones (half their bytes >= 0x80, which
    pickle protocol 2 spells in two bytes: the pickled entry outgrows the raw)."""
    return [hashlib.blake2b(i.to_bytes(4, "big"), digest_size=32).digest() for i in range(n)]


@pytest.mark.timeout(120)
def test_a_publish_over_the_chunk_size_applies_everywhere_without_a_failed_tick(
    cluster: LocalCluster,
) -> None:
    space = ns("large/publish")
    blocks = random_chain(BLOCKS)
    with cluster.client(timeout_s=20) as c:
        register(c, "big-node")
        for first in range(3):  # several, so each follower gets more than one transmission
            resp = publish(c, "big-node", 1, space, blocks, first=first)
            assert resp.applied + resp.stale == BLOCKS
        wait_local_prefixes(c, live(cluster), space, blocks, [("big-node", BLOCKS)], 30)
    for r in cluster.replicas:
        text = Path(r.log_path).read_text(errors="replace")
        assert "failed _onTick" not in text, f"{r.replica_id}: {r.log_path}"
        assert "Traceback" not in text, f"{r.replica_id}: {r.log_path}"
