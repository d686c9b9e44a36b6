"""Which qemu accelerator the test VMs boot with: KVM where a guest kernel really runs, else TCG.

The rdma, power-cut and systemd VM tiers took 17.6 of a fresh CI run's 37 pytest
minutes under TCG emulation (Python in the guest is 10-100x slower emulated).
KVM is not usable everywhere /dev/kvm exists. On this project's 2-core hosts
(nested virtualisation) `-cpu host` aborts qemu ("failed to set MSR 0x10a",
IA32_ARCH_CAPABILITIES), and with `-cpu host,-arch-capabilities` real-mode code
runs (SeaBIOS, the kernel's setup: "Probing EDD") but the vCPU never gets past
the switch to protected mode. So the probe boots the guest's own kernel, with no
initrd, under each KVM candidate, and takes the first that gets as far as the
kernel's panic for want of a root file system (a whole kernel init) within
`PROBE_TIMEOUT_S`; TCG is the fallback. The answer is kept per host boot and
kernel (accel.json in the VM cache), so the probe's cost is paid once.

`KVDIR_VM_ACCEL=tcg` forces emulation; `KVDIR_VM_ACCEL=kvm` fails loudly when no
KVM candidate runs (`python -m tests.rdma.accel KERNEL` prints the choice).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVM_CPU_MODELS = ("host", "host,-arch-capabilities")
"""Tried in order. Not a named older model: the guest runs the host's Python and numpy
(shared over 9p), built for the host's instruction set."""
TCG = ("-accel", "tcg,thread=multi", "-cpu", "max")
PROBE_TIMEOUT_S = 20.0
"""A kernel reaches its root-mount panic in 1-2 s under KVM; a loaded host gets slack."""
PROBE_POLL_S = 0.05
PROBE_MEMORY_MIB = 256
REACHED = b"Kernel panic"
"""What the probe's kernel prints last: it ran its whole init on this vCPU."""


class AccelError(RuntimeError):
    pass


def _runs(cpu: str, kernel: Path) -> bool:
    """Does `kernel` boot through its init under KVM with this CPU model?"""
    with tempfile.TemporaryDirectory(prefix="kvdir-kvm-probe-") as tmp:
        log = Path(tmp) / "console.log"
        args = [
            "qemu-system-x86_64",
            *("-accel", "kvm", "-cpu", cpu, "-m", str(PROBE_MEMORY_MIB), "-smp", "1"),
            *("-display", "none", "-nodefaults", "-no-reboot", "-monitor", "none"),
            *("-serial", f"file:{log}", "-kernel", str(kernel)),
            *("-append", "console=ttyS0 panic=-1"),
        ]
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        except OSError:
            return False
        try:
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                if log.exists() and REACHED in log.read_bytes():
                    return True
                if proc.poll() is not None:
                    return log.exists() and REACHED in log.read_bytes()
                time.sleep(PROBE_POLL_S)
            return False
        finally:
            proc.kill()
            proc.wait()


def _probe(kernel: Path) -> tuple[str, ...]:
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        for cpu in KVM_CPU_MODELS:
            if _runs(cpu, kernel):
                return ("-accel", "kvm", "-cpu", cpu)
    return TCG


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@functools.cache
def qemu_args(kernel: Path) -> tuple[str, ...]:
    """`-accel ... -cpu ...` for test VMs booting `kernel` (probed once per host boot)."""
    forced = os.environ.get("KVDIR_VM_ACCEL", "")
    if forced == "tcg":
        return TCG
    # Beside the image folders: the three VM tiers' images hold one Debian kernel.
    memo = kernel.parent.parent / "accel.json"
    st = kernel.stat()
    key = f"{_boot_id()} {st.st_size} {st.st_mtime_ns}"
    try:
        seen = json.loads(memo.read_text())
        found = tuple(seen["args"]) if seen.get("key") == key and _boot_id() else ()
    except (OSError, ValueError, KeyError, TypeError):
        found = ()
    if not found:
        found = _probe(kernel)
        with contextlib.suppress(OSError):
            memo.write_text(json.dumps({"key": key, "args": list(found)}))
    if forced == "kvm" and found == TCG:
        raise AccelError("KVDIR_VM_ACCEL=kvm, but no KVM vCPU runs here (tests/rdma/accel.py)")
    return found


def uses_kvm(kernel: Path) -> bool:
    return "kvm" in qemu_args(kernel)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.rdma.accel KERNEL")
    print(" ".join(qemu_args(Path(sys.argv[1]))))
