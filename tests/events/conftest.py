"""Fixtures of the events tier: one real 3-replica directory for the tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster


@pytest.fixture(scope="session")
def events_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(str(tmp_path_factory.mktemp("events-directory")), size=3)
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


@pytest.fixture
def directory(events_cluster: LocalCluster) -> Iterator[DirectoryClient]:
    with events_cluster.client(timeout_s=10) as c:
        yield c
