"""Fixtures of the gateway tier: a trained tokenizer, echo backends, one directory replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.local import LocalCluster
from tests.gateway.helpers import CHAT_TEMPLATE, Backends, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tok")
    template = d / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    return train_tokenizer(d), template


@pytest.fixture
def backends() -> Iterator[Backends]:
    b = Backends(["b1", "b2", "b3"]).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectoryClient]:
    """One real directory replica process (Raft of one) and a client of it."""
    c = LocalCluster(str(tmp_path_factory.mktemp("dir")), size=1)
    try:
        c.start(timeout_s=30)
        with c.client(timeout_s=10) as client:
            yield client
    finally:
        c.stop()
