"""The pod the image tier runs: three directory replicas and two agents in one netns.

Every container is the one image with a different command (the role), run
as it would be in production: `--read-only` root, the image's non-root
user, the config from deploy/config's templates mounted read-only at
/etc/kvdir/, a volume per replica at /var/lib/kvdir, `--restart always`.
The pod is `--network none`: one network namespace holding only `lo`, so
replicas and agents find each other on 127.0.0.1 ports and nothing outside
the pod can reach them. The test process has no way in either: every probe
runs inside a container (`podman exec ... kvdir ctl ...`), as an operator
with `kubectl exec` would.
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.deploy.test_systemd_vm import to_toml
from tests.image.podman import Podman, PodmanError

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
POD = "kvdir-pod"
SHM_SIZE = "64m"
"""The pod's /dev/shm, shared by its containers (IPC namespace): both agents' pools."""
REPLICAS = ("d0", "d1", "d2")
AGENTS = ("a", "b")
MODEL = "image-tier-model"
BLOCK_TOKENS = 16
BLOCKS = 4
SLOT_BYTES = 65536
SLOTS = 64
START_TIMEOUT_S = 180.0
"""Five containers from `podman run` to healthy, on a loaded 2-core machine."""
STEP_TIMEOUT_S = 90.0
STOP_GRACE_S = 30
"""podman stop's SIGTERM-to-SIGKILL grace, as the StatefulSet's terminationGracePeriodSeconds."""
POLL_S = 0.5
RAFT_ON_A_SHARED_HOST = {
    "append_entries_period_s": 0.1,
    "election_min_s": 1.0,
    "election_max_s": 2.0,
    "connection_timeout_s": 2.0,
    "leader_fallback_s": 2.0,
    "startup_grace_s": 2.0,
}
"""The only change to the template's [raft]: what docs/operations.md ("Slow hosts") tells
operators of starved hosts to set. This 2-core machine runs other jobs beside the tier
(load 15 seen), and the template's 0.15-0.3 s elections then depose leaders whose
heartbeats are merely late (eight elections in a minute in one run)."""


GATEWAY = "kvdir-gateway"
BACKEND = "engine-stub"
"""An engine's stand-in for the gateway: Python's http.server from the image, answering
GET / (the gateway's health_path here) with 200."""
BACKEND_NODE = "agent-a/stub/dp0"
GATEWAY_LISTEN = "127.0.0.1:8080"
BACKEND_LISTEN = ("127.0.0.1", 8000)


def replica_container(r: str) -> str:
    return f"kvdir-directory-{r}"


def agent_container(a: str) -> str:
    return f"kvdir-agent-{a}"


def grpc(r: str) -> str:
    return f"127.0.0.1:{7101 + REPLICAS.index(r)}"


ALL_GRPC = ",".join(grpc(r) for r in REPLICAS)


def _template(name: str) -> dict[str, Any]:
    with open(REPO / "deploy" / "config" / name, "rb") as f:
        return tomllib.load(f)


def directory_config(replica: str) -> dict[str, Any]:
    """deploy/config/directory.toml with this pod's identity and loopback addresses."""
    i = REPLICAS.index(replica)
    cfg = _template("directory.toml")
    cfg.update(
        replica_id=replica,
        raft_address=f"127.0.0.1:{7001 + i}",
        grpc_address=grpc(replica),
        metrics_address=f"127.0.0.1:{7201 + i}",
        data_dir="/var/lib/kvdir/directory",
    )
    cfg["peers"] = [
        {"replica_id": r, "raft_address": f"127.0.0.1:{7001 + j}", "grpc_address": grpc(r)}
        for j, r in enumerate(REPLICAS)
        if r != replica
    ]
    cfg["raft"] = {**cfg.get("raft", {}), **RAFT_ON_A_SHARED_HOST}
    return cfg


def agent_config(agent: str) -> dict[str, Any]:
    """deploy/config/agent.toml for one of the pod's agents; TCP between them, like two nodes."""
    port = 7301 + 10 * AGENTS.index(agent)
    cfg = _template("agent.toml")
    cfg.update(
        node_id=f"agent-{agent}",
        host="127.0.0.1",
        directory=[grpc(r) for r in REPLICAS],
        listen=f"127.0.0.1:{port}",
        metrics_address=f"127.0.0.1:{port + 1}",
        transports=["tcp"],
    )
    pool = dict(cfg["pools"][0])
    pool.update(model=MODEL, block_tokens=BLOCK_TOKENS, slot_bytes=SLOT_BYTES, slots=SLOTS)
    for key in ("dtype", "layout"):
        pool.pop(key, None)
    cfg["pools"] = [pool]
    return cfg


def gateway_config() -> dict[str, Any]:
    """deploy/config/gateway.toml routing to the stub backend; token-id prompts only."""
    cfg = _template("gateway.toml")
    cfg.update(listen=GATEWAY_LISTEN, directory=[grpc(r) for r in REPLICAS], health_path="/")
    model = dict(cfg["models"][0])
    model.update(name=MODEL, tokenizer="", chat_template="", block_tokens=BLOCK_TOKENS)
    cfg["models"] = [model]
    host, port = BACKEND_LISTEN
    cfg["backends"] = [
        {
            "url": f"http://{host}:{port}",
            "node_id": BACKEND_NODE,
            "host": host,
            "transports": ["tcp"],
            "max_concurrency": 4,
        }
    ]
    return cfg


def write_configs(folder: Path) -> dict[str, Path]:
    """Container name -> its config file on the host, in start order."""
    docs = {replica_container(r): directory_config(r) for r in REPLICAS}
    docs |= {agent_container(a): agent_config(a) for a in AGENTS}
    docs[GATEWAY] = gateway_config()
    out = {}
    for name, doc in docs.items():
        out[name] = folder / f"{name}.toml"
        out[name].write_text(to_toml(doc))
        out[name].chmod(0o644)  # read by the image's user through the bind mount
    return out


ROLES = {
    "kvdir-directory-": (["directory", "serve"], "/etc/kvdir/directory.toml"),
    "kvdir-agent-": (["agent", "serve"], "/etc/kvdir/agent.toml"),
    GATEWAY: (["gateway"], "/etc/kvdir/gateway.toml"),
}


def run_args(name: str, config: Path, image: str) -> list[str]:
    """`podman run` for one of the pod's kvdir containers (the role is the command)."""
    ((command, target),) = [v for k, v in ROLES.items() if name.startswith(k)]
    args = ["run", "--detach", "--pod", POD, "--name", name, "--restart", "always"]
    args += ["--read-only", "--volume", f"{config}:{target}:ro"]
    if command[0] == "directory":
        args += ["--volume", f"{name}-data:/var/lib/kvdir"]
    return [*args, image, *command, "--config", target]


def backend_args(image: str) -> list[str]:
    """The stub engine: SIGINT stops http.server cleanly (PID 1 ignores an unhandled SIGTERM)."""
    host, port = BACKEND_LISTEN
    return [
        *("run", "--detach", "--pod", POD, "--name", BACKEND, "--read-only"),
        *("--stop-signal", "SIGINT", "--entrypoint", "python", image),
        *("-m", "http.server", "--bind", host, "--directory", "/tmp", str(port)),
    ]


def wait(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll `probe` until it returns a value; PodmanError from it counts as not yet."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            got = probe()
            if got is not None:
                return got
        except PodmanError as e:
            last = str(e)[-1500:]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}: {last}")
        time.sleep(POLL_S)


def ctl(podman: Podman, via: str, *args: str) -> str:
    """`kvdir ctl ...` run inside container `via` (on the pod's loopback)."""
    return podman("exec", via, "kvdir", "ctl", *args).stdout


def status(podman: Podman, via: str, replicas: tuple[str, ...] = REPLICAS) -> dict[str, Any]:
    out = ctl(podman, via, "status", "--json", "--timeout", "5", "--addr", _addrs(replicas))
    by_addr: dict[str, Any] = json.loads(out)
    return {r: by_addr.get(grpc(r), {}) for r in replicas}


def _addrs(replicas: tuple[str, ...]) -> str:
    return ",".join(grpc(r) for r in replicas)


def leader(
    podman: Podman, via: str, replicas: tuple[str, ...] = REPLICAS, after_term: int = -1
) -> tuple[str, int] | None:
    """(leader, term) once every replica in `replicas` answers and names one leader in a
    term after `after_term`."""
    st = status(podman, via, replicas)
    leaders = [s for s in st.values() if s.get("role") == "ROLE_LEADER"]
    if len(leaders) != 1 or int(leaders[0].get("term", 0)) <= after_term:
        return None
    lead = str(leaders[0]["replica_id"])
    if all(s.get("leader_id") == lead for s in st.values()):
        return lead, int(leaders[0]["term"])
    return None


def lookup_blocks(podman: Podman, via: str, replica: str, hashes: list[str], node: str) -> int:
    """Blocks of `hashes` that `kvdir ctl lookup` on `replica` says `node` holds."""
    out = ctl(
        podman,
        via,
        *("lookup", "--json", "--timeout", "5", "--addr", grpc(replica)),
        *("--model", MODEL, "--block-tokens", str(BLOCK_TOKENS), "--hashes", ",".join(hashes)),
    )
    matches = json.loads(out).get("matches", [])
    held = [int(m.get("prefix_blocks", 0)) for m in matches if m.get("node_id") == node]
    return max(held, default=0)


def engine(podman: Podman, agent: str, mode: str, seed: int) -> dict[str, Any]:
    """tests/image/engine.py run inside an agent's container (the engine on that node)."""
    script = (Path(__file__).parent / "engine.py").read_text()
    args = [mode, MODEL, str(BLOCK_TOKENS), str(BLOCKS), str(seed)]
    name = agent_container(agent)
    out = podman("exec", "--interactive", name, "python", "-", *args, stdin=script)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
