"""Podman for the image tier: a private store, the settings this machine needs, bounded calls.

Every run gets its own store (graph root, run root, volumes, libpod state)
under a temporary folder, so the image is built from a clean state and
nothing outlives the run (`reset` removes it). The settings are written
into that folder and handed to podman through CONTAINERS_CONF and friends:

- `runtime = "runc"`: crun refuses this machine's cgroup (v1) setup;
- `default_ulimits = []`: the default ulimits are refused here;
- `cgroup_manager = "cgroupfs"`, `events_logger = "file"`: no systemd here;
- registries.conf with no search registries: nothing can be pulled, the base
  image is imported from the mmdebstrap tarball and the pause image is built
  locally from catatonit;
- `base_hosts_file`: the test's /etc/hosts for every container. It maps the
  StatefulSet's per-pod DNS name to 127.0.0.1, what cluster DNS would answer
  (podman 4.3 drops a kube Pod's hostAliases under --network none).

Pods are made with `--network none`: the pod's network namespace holds only
`lo`, so its containers reach each other on 127.0.0.1 and nothing else can
reach them. Without systemd, podman schedules no healthcheck timers (it logs
"unable to get systemd connection"); `podman healthcheck run` runs the
image's HEALTHCHECK on demand, which is how the tier waits for health.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("podman", "runc", "catatonit", "mmdebstrap", "apt-cache", "git")
INSTALL_HINT = "apt-get install --no-install-recommends podman runc catatonit mmdebstrap"
PROBES_AT_ONCE = 2
"""Healthchecks run in parallel (the machine's cores): each is a Python start of the CLI."""
CALL_TIMEOUT_S = 120.0
"""One podman command (run, exec, stop); the build and waits have their own bounds."""
POLL_S = 0.25

CONTAINERS_CONF = """\
[containers]
default_ulimits = []
base_hosts_file = "{hosts}"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{root}/tmp"
volume_path = "{root}/volumes"
"""
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{root}/graph"
runroot = "{root}/run"
"""
REGISTRIES_CONF = "unqualified-search-registries = []\n"


class PodmanError(RuntimeError):
    """A podman command failed or ran past its bound; the message has its output."""


@dataclass(frozen=True, slots=True)
class Podman:
    root: Path

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CONTAINERS_CONF": str(self.root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(self.root / "registries.conf"),
        }

    def __call__(
        self,
        *args: str,
        timeout_s: float = CALL_TIMEOUT_S,
        check: bool = True,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["podman", *args]
        try:
            p = subprocess.run(
                cmd,
                env=self.env(),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise PodmanError(f"{' '.join(cmd)} took over {timeout_s:.0f}s") from e
        if check and p.returncode != 0:
            raise PodmanError(
                f"{' '.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout)[-3000:]}"
            )
        return p

    def inspect(self, name: str, fmt: str) -> str:
        return self("inspect", "--format", fmt, name).stdout.strip()

    def healthy(self, name: str) -> bool:
        """Run the container's HEALTHCHECK once (it waits up to its own timeout)."""
        return self("healthcheck", "run", name, check=False).returncode == 0

    def wait_healthy(self, names: list[str], timeout_s: float) -> dict[str, float]:
        """Seconds from now until each container's HEALTHCHECK passed, bounded.

        Containers are probed PROBES_AT_ONCE at a time: one probe is a `podman
        exec` and a Python start of the CLI (seconds on a loaded host); in turn,
        each container's time would include the others' probes, and all at once,
        they starve the daemons they probe.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s

        def one(name: str) -> float | None:
            while True:
                if self.healthy(name):
                    return round(time.monotonic() - t0, 2)
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S)

        with ThreadPoolExecutor(max_workers=PROBES_AT_ONCE) as pool:
            got = dict(zip(names, pool.map(one, names), strict=True))
        missing = [n for n, s in got.items() if s is None]
        if missing:
            logs = {n: self("logs", "--tail", "20", n, check=False).stderr for n in missing}
            raise PodmanError(f"not healthy after {timeout_s:.0f}s: {missing}; logs: {logs}")
        return {n: s for n, s in got.items() if s is not None}

    def reset(self) -> None:
        """Remove every container, image and volume of this store, then the store."""
        self("system", "reset", "--force", check=False, timeout_s=300)
        shutil.rmtree(self.root, ignore_errors=True)


def create(hosts: dict[str, str]) -> Podman:
    """A fresh private store; `hosts` (name -> address) becomes every container's /etc/hosts."""
    root = Path(tempfile.mkdtemp(prefix="kvdir-image-podman-"))
    (root / "tmp").mkdir()
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{addr} {name}" for name, addr in hosts.items()]
    (root / "hosts").write_text("\n".join(lines) + "\n")
    (root / "containers.conf").write_text(CONTAINERS_CONF.format(root=root, hosts=root / "hosts"))
    (root / "storage.conf").write_text(STORAGE_CONF.format(root=root))
    (root / "registries.conf").write_text(REGISTRIES_CONF)
    return Podman(root)


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def unusable_reason(podman: Podman) -> str | None:
    """Why podman cannot run containers here (None: it can).

    The probe is a real container: a pod's infra container (podman's pause
    image, built locally from catatonit) started by runc.
    """
    if missing_tools():
        return f"missing {', '.join(missing_tools())} ({INSTALL_HINT})"
    if os.geteuid() != 0:
        return "the image tier runs podman as root (mmdebstrap, overlay storage, runc)"
    for args in (
        ("info",),
        ("pod", "create", "--network", "none", "--name", "kvdir-probe"),
        ("pod", "start", "kvdir-probe"),
    ):
        p = podman(*args, check=False)
        if p.returncode != 0:
            podman("pod", "rm", "--force", "kvdir-probe", check=False)
            return (
                f"podman cannot run a container here: podman {' '.join(args)}: "
                + (p.stderr.strip()[-800:])
            )
    podman("pod", "rm", "--force", "kvdir-probe")
    return None
