"""Pull the power of a VM running three replicas and a writer, again and again; check each time.

Host side of the power-cut test (the guest side is `guest.py`, the VM `vm.py`).
One run: fresh disks, then boot after boot of the *same* disks. Every boot
but the first begins with the guest's checks of everything acknowledged so
far; every boot but the last ends with `Machine.cut()` at a random moment:
mostly while the writer runs (uniform in `[1, write_window_s]` s after it
starts; emulated, the writer manages tens of writes a second), sometimes
(`early_cut_p`) within `early_cut_window_s` of the replicas' launch, while
they open their journals, elect and catch up. The host keeps the acknowledged set: lines
``A <seq>`` from the acknowledgement port, complete lines only.

Verdicts per checked boot:
- ``below_majority``: acknowledged writes that fewer than two replicas hold in
  their durable files (snapshot + journal, read before they start): must be 0.
- ``lost``: acknowledged writes some replica lacks once all three have
  converged: must be 0.
- ``agree``: the three replicas reached one applied index with one state digest.

Command line (root, qemu, mmdebstrap)::

    python -m tests.powercut.run --cuts 24 --seed 1 --results bench/results
    python -m tests.powercut.run --scenario replica
    python -m tests.powercut.run --scenario both --cuts 2

``both`` (what CI runs) begins with the single-replica cut on boot 0 and then
writes again until the first full cut, so one set of boots shows both.

The guest runs under KVM where a probe finds a kernel booting (tests/rdma/accel.py:
nested KVM does not run guests on every host), else under TCG emulation; `--kvm`
insists on KVM, and with it the replicas keep their default timeouts. Under
emulation Python is 10-100x slower than on a host, so the replicas run with
the election timeouts a starved host would set (`EMULATION_TUNING`, as the
systemd VM test does); `--serve-arg` adds or overrides flags.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.powercut import vm
from tests.powercut.guest import WRITING_AGAIN
from tests.rdma import accel
from tests.rdma.vm import OUT_MOUNT, VmError

BOOT_TIMEOUT_S = 3600.0
"""Longest a boot may take to report its checks (emulated: 3-5 min; on a host loaded by
other work, importing the replicas alone has taken over 10 min)."""
EMULATION_TUNING = (
    "append_entries_period_s=0.1",
    "election_min_s=3.0",
    "election_max_s=6.0",
    "connection_timeout_s=6.0",
    "leader_fallback_s=6.0",
    "startup_grace_s=6.0",
)
POLL_S = 0.05
MAJORITY = 2
REPLICA_WRITES = 500
"""The single-replica cut's acknowledged writes per step (before the cut, while the
victim is down, after its restart); the command line's default."""


@dataclass
class Cut:
    boot: int
    phase: str
    """"writing" or "startup": what the guest was doing when the power went."""
    after_s: float
    acked_this_boot: int


@dataclass
class Check:
    boot: int
    acked: int
    below_majority: int
    lost: int
    agree: bool
    torn_tails_cut: int
    errors: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.below_majority and not self.lost and self.agree and not self.errors


@dataclass
class RunResult:
    scenario: str
    seed: int
    kvm: bool
    serve_args: list[str]
    commit: str
    cuts: list[Cut] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    acked_total: int = 0
    replica_cut: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        checks_ok = all(c.ok for c in self.checks) and bool(self.checks)
        return checks_ok and (self.scenario == "vm" or self.replica_cut.get("ok", False))


class PowerCutError(RuntimeError):
    """The VM did not get as far as a cut or a check; the message says where it stopped."""


def wait_line(m: vm.Machine, wanted: str, timeout_s: float, prefix: bool = False) -> float:
    """Wait for the guest to send `wanted` (a whole line, or a line's start) on the
    acknowledgement port; returns when it was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = m.lines()
        if any(x.startswith(wanted) for x in lines) if prefix else wanted in lines:
            return time.monotonic()
        if not m.alive():
            raise PowerCutError(f"the VM stopped before {wanted!r}:\n{_tail(m)}")
        time.sleep(POLL_S)
    m.cut()
    raise PowerCutError(f"no {wanted!r} within {timeout_s:.0f}s:\n{_tail(m)}")


def _tail(m: vm.Machine) -> str:
    parts = []
    for p in (m.out_dir / "job.log", m.console_path):
        text = p.read_text(errors="replace") if p.exists() else "(missing)"
        parts.append(f"--- {p.name}\n{text[-3000:]}")
    return "\n".join(parts)


def acks(m: vm.Machine) -> list[int]:
    return [int(line[2:]) for line in m.lines() if line.startswith("A ") and line[2:].isdigit()]


def verdict(report: dict[str, Any], acked: set[int]) -> Check:
    errors: list[str] = []
    offline = report.get("offline", {})
    missing_where: dict[int, int] = {}
    for name, rec in offline.items():
        if "error" in rec:
            errors.append(f"{name}: {rec['error']}")
        for s in rec.get("missing", []):
            missing_where[s] = missing_where.get(s, 0) + 1
    holders = len(offline)
    below = sum(1 for n in missing_where.values() if holders - n < MAJORITY) if offline else 0
    lost = {s for lacking in report.get("online_missing", {}).values() for s in lacking}
    return Check(
        boot=report["boot"],
        acked=len(acked),
        below_majority=below,
        lost=len(lost),
        agree=bool(report.get("converged", {}).get("digest")),
        torn_tails_cut=sum(report.get("cuts", {}).values()),
        errors=errors,
        seconds=report.get("timings", {}),
    )


def _cut_during_startup(m: vm.Machine, after_s: float, timeout_s: float) -> bool:
    """Cut `after_s` after the guest launched the replicas (opening journals, electing),
    unless it has finished its checks by then. True if it cut."""
    launched = wait_line(m, "C launching", timeout_s, prefix=True)
    while m.alive() and time.monotonic() < launched + after_s and "C CHECKED" not in m.lines():
        time.sleep(POLL_S)
    if "C CHECKED" in m.lines():
        return False
    m.cut()
    return True


def guest_command(
    boot: int,
    scenario: str,
    final: bool,
    serve_args: list[str],
    source: Path,
    replica_writes: int = REPLICA_WRITES,
) -> str:
    guest_scenario = "replica" if scenario == "both" and boot == 0 else scenario
    if final or (scenario == "both" and boot > 0):
        guest_scenario = "vm"
    cmd = (
        f"python -m tests.powercut.guest --out {OUT_MOUNT} --boot {boot} "
        f"--scenario {guest_scenario}"
    )
    if final:
        cmd += " --final"
    elif scenario == "both" and boot == 0:
        cmd += " --then-write"
    if boot == 0 and scenario in ("replica", "both"):
        cmd += f" --writes {replica_writes}"
    for a in serve_args:
        cmd += f" --serve-arg={a}"
    return vm.job_script(cmd, source)


def run(
    cuts: int,
    seed: int,
    work: Path,
    scenario: str = "vm",
    serve_args: list[str] | None = None,
    write_window_s: float = 45.0,
    early_cut_p: float = 0.15,
    early_cut_window_s: float = 120.0,
    replica_writes: int = REPLICA_WRITES,
    boot_timeout_s: float = BOOT_TIMEOUT_S,
    log: bool = True,
    kvm: bool | None = None,
) -> RunResult:
    """`cuts` power cuts on one set of disks, each followed by a checking boot.

    `kvm`: None boots under KVM where a vCPU runs here, else TCG (tests/rdma/accel.py);
    True insists on KVM; False emulates.
    """
    rng = random.Random(seed)
    source, commit = vm.source_snapshot(work / "src")  # first: before anything can change
    image = vm.build()
    if kvm and not accel.uses_kvm(image.kernel):
        raise VmError("KVM asked for, but no KVM vCPU runs here (tests/rdma/accel.py)")
    if kvm is not True:
        # Also under a probed KVM: in CI the guest shares two busy cores with the suite.
        serve_args = [f"--tune={t}" for t in EMULATION_TUNING] + list(serve_args or [])
    kvm = accel.uses_kvm(image.kernel) if kvm is None else kvm
    disks = vm.make_disks(work / "disks")
    out = work / "share"
    res = RunResult(scenario, seed, kvm, list(serve_args or []), commit)
    acked: set[int] = set()
    t0 = time.monotonic()
    if scenario == "both" and cuts < 1:
        raise ValueError("the `both` scenario needs at least one full cut")
    boots = cuts + 1 if scenario in ("vm", "both") else 2
    for boot in range(boots):
        (out).mkdir(parents=True, exist_ok=True)
        (out / "acked.txt").write_text("\n".join(map(str, sorted(acked))))
        final = boot == boots - 1
        job = guest_command(boot, scenario, final, res.serve_args, source, replica_writes)
        m = vm.start(image, job, out, disks, boot, kvm, source)
        replica_boot = boot == 0 and scenario in ("replica", "both")
        early = not replica_boot and scenario != "replica" and not final
        early = early and rng.random() < early_cut_p
        if early and _cut_during_startup(m, rng.uniform(1.0, early_cut_window_s), boot_timeout_s):
            res.cuts.append(Cut(boot, "startup", round(time.monotonic() - m.started, 2), 0))
            if log:
                print(f"[powercut] boot {boot}: cut while the replicas started", file=sys.stderr)
            continue
        wait_line(m, "C CHECKED", boot_timeout_s)
        if boot > 0:
            report = json.loads((out / f"report-{boot}.json").read_text())
            res.checks.append(verdict(report, acked))
            if log:
                print(f"[powercut] boot {boot}: {res.checks[-1]}", file=sys.stderr)
        if final:
            m.wait(boot_timeout_s)
            break
        if replica_boot:
            wait_line(m, "C DONE", boot_timeout_s)
            report = json.loads((out / f"report-{boot}.json").read_text())
            res.replica_cut = replica_verdict(report["replica_cut"], set(acks(m)))
        if scenario == "replica":
            m.wait(boot_timeout_s)
            acked |= set(acks(m))
            continue
        wrote_at = wait_line(m, WRITING_AGAIN if replica_boot else "C WRITING", boot_timeout_s)
        delay = rng.uniform(1.0, write_window_s)
        while time.monotonic() < wrote_at + delay and m.alive():
            time.sleep(POLL_S)
        m.cut()
        got = acks(m)
        acked |= set(got)
        res.cuts.append(Cut(boot, "writing", round(delay, 2), len(got)))
        if log:
            print(
                f"[powercut] boot {boot}: cut {delay:.2f}s into writing, {len(got)} acked",
                file=sys.stderr,
            )
    res.acked_total = len(acked)
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def replica_verdict(rep: dict[str, Any], acked: set[int]) -> dict[str, Any]:
    lost = {s for lacking in rep.get("online_missing", {}).values() for s in lacking}
    return {
        **{k: rep[k] for k in ("victim", "acked_at_cut", "acked", "failed_writes")},
        "acked_on_port": len(acked),
        "lost": len(lost),
        "agree": bool(rep.get("converged", {}).get("digest")),
        "torn_tails_cut": sum(rep.get("cuts", {}).values()),
        "ok": not lost and bool(rep.get("converged", {}).get("digest")),
    }


def markdown(res: RunResult) -> str:
    lines = [
        f"# Power-cut run ({res.scenario}), seed {res.seed}",
        "",
        f"- {len(res.cuts)} power cuts, {len(res.checks)} checked boots, {res.acked_total} "
        f"acknowledged writes in all, {res.seconds:.0f} s, {'KVM' if res.kvm else 'TCG'}",
        f"- commit {res.commit[:12]} (the guest ran `git archive` of it); serve args: "
        f"{' '.join(res.serve_args) or '(defaults)'}",
        f"- verdict: **{'PASS' if res.ok else 'FAIL'}**",
        "",
        "| boot | cut | at s | acked this boot | acked so far | below majority | lost | agree "
        "| torn tails cut |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    checks = {c.boot: c for c in res.checks}
    for cut in res.cuts:
        c = checks.get(cut.boot + 1)
        cells = [str(c.acked), str(c.below_majority), str(c.lost), str(c.agree),
                 str(c.torn_tails_cut)] if c else ["-"] * 5  # fmt: skip
        lines.append(
            f"| {cut.boot} | {cut.phase} | {cut.after_s} | {cut.acked_this_boot} | "
            + " | ".join(cells)
            + " |"
        )
    if res.replica_cut:
        lines += ["", f"Single-replica cut: `{json.dumps(res.replica_cut)}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.powercut.run", description=__doc__)
    ap.add_argument("--cuts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenario", choices=("vm", "replica", "both"), default="vm")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `directory serve` flag")
    ap.add_argument(
        "--work", default="", help="folder for disks and the share (default: a temp dir)"
    )
    ap.add_argument("--results", default="", help="write powercut-DATE.{md,json} here")
    ap.add_argument("--boot-timeout-s", type=float, default=BOOT_TIMEOUT_S)
    ap.add_argument(
        "--kvm", action="store_true", default=None, help="insist on KVM (default: probed)"
    )
    ap.add_argument("--tcg", action="store_false", dest="kvm", help="emulate (TCG)")
    ap.add_argument("--early-cut-p", type=float, default=0.15)
    ap.add_argument("--write-window-s", type=float, default=45.0)
    ap.add_argument("--replica-writes", type=int, default=REPLICA_WRITES)
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="kvdir-powercut-"))
    try:
        res = run(args.cuts, args.seed, work, args.scenario, args.serve_arg,
                  boot_timeout_s=args.boot_timeout_s, kvm=args.kvm,
                  early_cut_p=args.early_cut_p, write_window_s=args.write_window_s,
                  replica_writes=args.replica_writes)  # fmt: skip
    except (VmError, PowerCutError) as e:
        print(f"[powercut] {e}", file=sys.stderr)
        return 2
    text = markdown(res)
    sys.stdout.write(text)
    if args.results:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        base = Path(args.results) / f"powercut-{res.scenario}-{stamp}"
        base.with_suffix(".md").write_text(text)
        base.with_suffix(".json").write_text(json.dumps(asdict(res), indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
