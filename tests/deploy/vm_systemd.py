"""A VM with systemd as PID 1, for running deploy/systemd's units for real.

The image comes from the rdma tier's harness (tests/rdma/vm.py: Debian's
generic kernel, an mmdebstrap'd bookworm userland packed as an initramfs,
cached under $KVDIR_VM_CACHE keyed on the recipe and every package version),
with a different recipe: systemd and systemd-sysv, python3-venv (a real
`python3 -m venv` + pip, offline), only the virtio/9p modules, and no
RDMA. The kernel starts /lib/systemd/systemd; a unit of the image,
kvdir-vm-job.service, mounts the 9p shares named on the kernel command line,
runs `job.sh` from the results share, saves the journal, writes the exit
status to `rc` and powers off. The VM has no network device (`-nic none`).

Everything Python comes from wheels: kvdir's pinned runtime dependencies
(fetched here with `pip wheel`, cached, keyed on pyproject's dependency list)
are installed into /opt/kvdir/venv while the image is built (`python3 -m
venv` and an offline `pip install`, run in the image root with chroot): under
emulation pip takes minutes for numpy and grpcio, and they change only with
pyproject. kvdir itself is built from the checkout for every run (`pip wheel
--no-deps`) and installed in the guest into that venv, offline. The guest's
Python is Debian bookworm's 3.11, like the host's CI Python, so the cp311
manylinux wheels fit.

Command line: `python -m tests.deploy.vm_systemd build` (prints the image folder).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from tests.rdma import vm

RECIPE_VERSION = "1"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "mount",
    "kmod",
    "procps",
    "python3",
    "python3-venv",
    "libstdc++6",
)
"""libstdc++6: grpcio's extension links it (python3 alone does not pull it in)."""
MODULES = (
    *("virtio", "virtio_ring", "virtio_pci", "virtio_pci_modern_dev", "virtio_pci_legacy_dev"),
    *("9p", "9pnet", "9pnet_virtio", "netfs", "fscache"),
)
INIT = "/lib/systemd/systemd"
PIP_TIMEOUT_S = 600

JOB_WRAPPER = f"""#!/bin/sh
# kvdir-vm-job.service (tests/deploy/vm_systemd.py): mount the shares, run the job, power off.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
modprobe virtio_pci
modprobe 9pnet_virtio
modprobe 9p
for spec in $(tr ' ' '\\n' < /proc/cmdline | sed -n 's/^kvdir.share=//p'); do
  tag=${{spec%%:*}}; rest=${{spec#*:}}; path=${{rest%:*}}; mode=${{rest##*:}}
  mkdir -p "$path"
  if [ "$mode" = ro ]; then opts=ro,cache=loose; else opts=rw; fi
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,$opts "$tag" "$path"
done
out={vm.OUT_MOUNT}
cd "$(cat "$out/cwd")"
sh "$out/job.sh" > "$out/job.log" 2>&1
echo $? > "$out/rc"
journalctl -b --no-pager -o short-monotonic > "$out/journal.txt" 2>&1
sync
echo o > /proc/sysrq-trigger
sleep 30
"""

JOB_UNIT = """[Unit]
Description=kvdir VM test job (tests/deploy/vm_systemd.py)
After=basic.target

[Service]
Type=exec
ExecStart=/usr/local/sbin/kvdir-vm-job
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""

VENV = "/opt/kvdir/venv"
"""Where docs/operations.md installs kvdir, and where deploy/systemd's units run it from."""
MASKED = ("serial-getty@ttyS0.service", "getty@tty1.service", "getty.target")
"""Nobody logs in; a getty on the serial console would only fight the job's output."""


def _chroot(root: Path, *cmd: str) -> None:
    try:
        p = subprocess.run(
            ["chroot", str(root), *cmd],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C.UTF-8"},
        )
    except subprocess.TimeoutExpired as e:
        raise vm.VmError(f"chroot {' '.join(cmd)} took over {PIP_TIMEOUT_S}s") from e
    if p.returncode != 0:
        raise vm.VmError(f"chroot {' '.join(cmd)} failed: {(p.stderr or p.stdout)[-2000:]}")


def _install_dependencies(root: Path, wheels: Path) -> None:
    """/opt/kvdir/venv with kvdir's runtime dependencies (not kvdir), offline."""
    staged = root / "tmp" / "kvdir-wheels"
    shutil.copytree(wheels, staged)
    try:
        _chroot(root, "python3", "-m", "venv", VENV)
        _chroot(
            root,
            f"{VENV}/bin/pip",
            *("install", "--no-index", "--no-cache-dir", "--disable-pip-version-check"),
            *("--find-links", "/tmp/kvdir-wheels", "-r", "/tmp/kvdir-wheels/requirements.txt"),
        )
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _finish(root: Path, wheels: Path) -> None:
    _install_dependencies(root, wheels)
    sbin = root / "usr" / "local" / "sbin"
    sbin.mkdir(parents=True, exist_ok=True)
    wrapper = sbin / "kvdir-vm-job"
    wrapper.write_text(JOB_WRAPPER)
    wrapper.chmod(0o755)
    units = root / "etc" / "systemd" / "system"
    (units / "kvdir-vm-job.service").write_text(JOB_UNIT)
    wants = units / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "kvdir-vm-job.service").symlink_to("/etc/systemd/system/kvdir-vm-job.service")
    default = units / "default.target"
    default.unlink(missing_ok=True)
    default.symlink_to("/lib/systemd/system/multi-user.target")
    for name in MASKED:
        (units / name).unlink(missing_ok=True)
        (units / name).symlink_to("/dev/null")
    (root / "etc" / "hostname").write_text("kvdir-vm\n")
    # Empty: systemd makes a machine id at boot (the image is shared by every run).
    (root / "etc" / "machine-id").write_text("")
    if not (root / "lib" / "systemd" / "systemd").exists():
        raise vm.VmError("the systemd package left no /lib/systemd/systemd in the guest")
    vm.drop_apt_caches(root)


def recipe(wheels: Path) -> vm.Recipe:
    """The image recipe; `wheels` (dependency_wheels()) go into its venv and its key."""
    deps = (wheels / "requirements.txt").read_text().split()
    return vm.Recipe(
        RECIPE_VERSION,
        PACKAGES,
        MODULES,
        lambda root: _finish(root, wheels),
        json.dumps(["systemd", JOB_WRAPPER, JOB_UNIT, MASKED, INIT, VENV, deps]),
    )


def build(log: bool = True) -> tuple[vm.Image, Path]:
    """The cached systemd image and the dependency wheels it holds (built on first use)."""
    wheels = dependency_wheels()
    return vm.build(log=log, recipe=recipe(wheels)), wheels


def boot(
    image: vm.Image, job: str, out_dir: Path, timeout_s: float, shares: list[tuple[str, bool]]
) -> vm.Result:
    """Boot with systemd as PID 1; `job` (shell) runs in the results folder."""
    return vm.boot(
        image,
        job,
        out_dir,
        timeout_s,
        cwd=vm.OUT_MOUNT,
        guest_shares=shares,
        init=INIT,
    )


# ---------------------------------------------------------------- wheels


def runtime_dependencies() -> list[str]:
    with open(vm.REPO_ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [str(d) for d in deps]


def _pip(args: list[str], cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        p = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise vm.VmError(f"pip took over {PIP_TIMEOUT_S}s: {' '.join(cmd)}") from e
    if p.returncode != 0:
        raise vm.VmError(f"{' '.join(cmd)} failed: {p.stderr.strip()[-2000:]}")


def dependency_wheels() -> Path:
    """Wheels of kvdir's pinned runtime dependencies for CPython 3.11 (cached)."""
    deps = runtime_dependencies()
    key = hashlib.sha256(json.dumps([sys.version_info[:2], deps]).encode()).hexdigest()[:16]
    dest = vm.cache_root() / f"wheels-{key}"
    if (dest / "requirements.txt").exists():
        return dest
    vm.cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=vm.cache_root(), prefix="wheels-build-") as tmp:
        staged = Path(tmp) / "wheels"
        _pip(["wheel", "--quiet", "--wheel-dir", str(staged), *deps])
        (staged / "requirements.txt").write_text("\n".join(deps) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        staged.rename(dest)
    return dest


SOURCE_PATHS = ("pyproject.toml", "README.md", "kvdir", "directory", "agent", "transfer", "proto")


def kvdir_wheel(dest: Path) -> Path:
    """Build kvdir's wheel from this checkout (a copy, so no build/ lands in the tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvdir-src-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
        for rel in SOURCE_PATHS:
            p = vm.REPO_ROOT / rel
            if p.is_dir():
                shutil.copytree(p, src / rel, ignore=ignore)
            else:
                shutil.copy2(p, src / rel)
        _pip(["wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dest), str(src)])
    found = sorted(dest.glob("kvdir-*.whl"))
    if len(found) != 1:
        raise vm.VmError(f"pip wheel left {len(found)} kvdir wheels in {dest}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m tests.deploy.vm_systemd build", file=sys.stderr)
        return 2
    try:
        image, wheels = build()
    except vm.VmError as e:
        print(f"[kvdir-vm] {e}", file=sys.stderr)
        return 2
    print(image.kernel.parent)
    print(wheels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
