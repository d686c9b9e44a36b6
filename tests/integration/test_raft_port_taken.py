"""A replica whose Raft port is taken fails its start in one line, within a bound.

pysyncobj retries a failed bind forever unless told otherwise; before the bound,
`kvdir directory serve` hung silently on a taken port (seen as a sharded bench's
replica that never started when another process held its port).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_a_taken_raft_port_fails_the_start(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    raft_port = holder.getsockname()[1]
    try:
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvdir.cli",
                "directory",
                "serve",
                "--replica-id",
                "r1",
                "--raft",
                f"127.0.0.1:{raft_port}",
                "--grpc",
                f"127.0.0.1:{_free_port()}",
                "--metrics",
                "",
                "--data-dir",
                str(tmp_path / "r1"),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=45,
        )
        took = time.monotonic() - t0
    finally:
        holder.close()
    assert proc.returncode != 0
    assert "cannot bind raft address" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert took < 40
