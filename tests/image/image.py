"""Building deploy/image's recipe the way `make image` does, and reading the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.image.podman import Podman, PodmanError

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "deploy" / "image" / "build.sh"
BUILD_TIMEOUT_S = 1200
"""A cold build: mmdebstrap (~40-70 s) and pip fetching the dependency wheels (minutes)."""
IMAGE_PYTHON = (3, 11)
"""bookworm's python3, the image's: the wheels this interpreter's pip fetches must fit it."""


@dataclass(frozen=True, slots=True)
class Built:
    ref: str
    image_id: str
    seconds: float
    log: str
    config: dict[str, Any]
    healthcheck: dict[str, Any]
    size_bytes: int


def version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def build(podman: Podman, tag: str) -> Built:
    """Run deploy/image/build.sh into `podman`'s store (cached base and wheels reused)."""
    env = {**podman.env(), "PYTHON": sys.executable, "IMAGE": tag}
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise PodmanError(f"the image build took over {BUILD_TIMEOUT_S}s") from e
    seconds = round(time.monotonic() - t0, 1)
    if p.returncode != 0:
        raise PodmanError(f"deploy/image/build.sh failed ({p.returncode}):\n{p.stderr[-5000:]}")
    ref, image_id = p.stdout.split()
    (inspected,) = json.loads(podman("image", "inspect", image_id).stdout)
    return Built(
        ref=ref,
        image_id=image_id,
        seconds=seconds,
        log=p.stderr,
        config=inspected["Config"],
        healthcheck=inspected["Healthcheck"],
        size_bytes=int(inspected["Size"]),
    )


def git_head() -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip()


def python_fits() -> bool:
    return sys.version_info[:2] == IMAGE_PYTHON and os.path.exists(BUILD_SCRIPT)
