"""Fixtures of the integration tier: real replica processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster
from tests.integration.helpers import wait_all_serving


def _started(base: Path) -> LocalCluster:
    """A 3-replica cluster in which every replica answers and follows one leader.

    `LocalCluster.start` returns once a majority agrees on a leader; on a busy
    2-core machine the third process may still be importing then, and a test
    that talks to it with a bare stub would see UNAVAILABLE.
    """
    c = LocalCluster(str(base), size=3)
    try:
        c.start(timeout_s=30)
        wait_all_serving(c, 30)
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A started 3-replica directory of real processes (all three serving)."""
    c = _started(tmp_path)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One started 3-replica cluster for a whole module of tests that kill nothing.

    Tests sharing it keep to their own node ids and namespaces.
    """
    c = _started(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(shared_cluster: LocalCluster) -> Iterator[DirectoryClient]:
    """A retrying client that knows every replica of `shared_cluster`."""
    with shared_cluster.client(timeout_s=10) as c:
        yield c
