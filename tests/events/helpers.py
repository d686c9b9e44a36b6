"""Helpers of the events tier: vLLM's real publisher in its own virtualenv.

vLLM is installed per version by scripts/install-vllm.sh into
``${KVDIR_VLLM_HOME:-~/.cache/kvdir}/vllm-<version>`` (two versions cannot
share one venv, and kvdir's own venv stays free of torch). `VllmEngine` runs
tests/events/vllm_driver.py there and talks JSON lines to it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdir.core.client import DirectoryClient
from kvdir.local import ClusterError, wait_for
from kvdir.v1 import directory_pb2 as pb

DRIVER = Path(__file__).with_name("vllm_driver.py")
VLLM_VERSIONS = ("0.33.0", "0.23.0")
START_S = 120.0
"""vLLM's import takes ~15 s on an idle 2-core machine, more under load."""
WAIT_S = 30.0


def vllm_home() -> Path:
    return Path(os.environ.get("KVDIR_VLLM_HOME", Path.home() / ".cache" / "kvdir"))


def vllm_python(version: str) -> str:
    """The vLLM venv's python; skipped (failed under CI) when it is not installed."""
    py = vllm_home() / f"vllm-{version}" / "bin" / "python"
    if not py.exists():
        why = f"vLLM {version} is not installed: run scripts/install-vllm.sh {version}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return str(py)


class VllmEngine:
    """vLLM's ZmqEventPublisher + BlockPool in a subprocess (tests/events/vllm_driver.py)."""

    def __init__(
        self,
        python: str,
        endpoint: str,
        replay_endpoint: str = "",
        log_path: str = os.devnull,
        int_hashes: bool = True,
        hash_algo: str = "sha256",
        block_size: int = 16,
        num_blocks: int = 64,
        dp_rank: int = 0,
        hash_seed: str = "",
    ) -> None:
        env = dict(os.environ)
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
        env.pop("PYTHONHASHSEED", None)
        if hash_seed:  # vLLM derives NONE_HASH from it (<= 0.23: random without it)
            env["PYTHONHASHSEED"] = hash_seed
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
        cmd = [
            python,
            str(DRIVER),
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay_endpoint,
            "--hash-algo",
            hash_algo,
            "--block-size",
            str(block_size),
            "--num-blocks",
            str(num_blocks),
            "--dp-rank",
            str(dp_rank),
        ]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
        )
        ready = self._read(START_S)
        if not ready.get("ready"):
            raise ClusterError(f"vLLM driver did not start: {ready}")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise ClusterError(f"vLLM driver silent for {timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            raise ClusterError(f"vLLM driver exited with {self.proc.wait(10)}")
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(WAIT_S)
        if "error" in reply:
            raise AssertionError(f"vLLM driver: {reply['error']}")
        return reply

    def store(self, rid: str, tokens: Sequence[int]) -> list[Any]:
        stored: list[Any] = self.call("store", rid=rid, tokens=list(tokens))["stored"]
        return stored

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=15)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._log.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_subscribed(eng: VllmEngine, messages: Callable[[], int]) -> None:
    """ZMQ drops what a PUB sends before the connection is up: publish 1-block
    warm-ups until the consumer has received one (later gaps then replay)."""
    sent = [0]

    def through() -> bool:
        if messages():
            return True
        sent[0] += 1
        eng.store(f"warm-{sent[0]}", tokens(10_000 + sent[0], 1))
        return messages() > 0

    wait_for(through, WAIT_S, "the engine's events to reach the consumer", 0.05)


def published_hashes(raw: Sequence[Any]) -> list[int | bytes]:
    """Hashes as the driver reported them (bytes came as hex)."""
    return [bytes.fromhex(h) if isinstance(h, str) else int(h) for h in raw]


def prefix(c: DirectoryClient, ns: pb.Namespace, chain: list[bytes], holder: str) -> int:
    resp = c.lookup(ns, chain, linearizable=True)
    return next((m.prefix_blocks for m in resp.matches if m.node_id == holder), 0)


def wait_prefix(
    c: DirectoryClient, ns: pb.Namespace, chain: list[bytes], holder: str, blocks: int
) -> None:
    seen: list[int] = []

    def ok() -> bool:
        seen[:] = [prefix(c, ns, chain, holder)]
        return seen[0] == blocks

    try:
        wait_for(ok, WAIT_S, f"{holder} to hold {blocks} blocks", 0.05)
    except ClusterError as e:
        raise ClusterError(f"{e} (last saw {seen})") from None


def tokens(salt: int, blocks: int, block_size: int = 16) -> list[int]:
    """Token ids of `blocks` full blocks that no other test uses."""
    start = 1000 + salt * 100_003
    return list(range(start, start + blocks * block_size))
