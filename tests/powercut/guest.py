"""Runs INSIDE the power-cut VM (tests/powercut/vm.py): replicas, a writer, the checks.

One boot does, in order (each step bounded):

1. mounts each replica's disk through a device-mapper linear target
   (/dev/vdX -> /dev/mapper/kvdir-rN -> /data/rN), ext4 as formatted;
2. if the replicas have data (every boot after the first): the *offline*
   check - each replica's durable state read straight from its snapshot and
   journal (`backup.recover_state`, read-only) - says which acknowledged
   writes (the host's list, `acked.txt`) each replica holds;
3. starts three `kvdir directory serve` processes on fixed loopback ports,
   waits until all three have applied the same index with the same state
   digest, and (the *online* check) looks up every acknowledged write on each;
4. writes `report-BOOT.json`, says ``C CHECKED`` on the acknowledgement port
   and then writes until the host pulls the power: every Publish that
   returned OK is reported as ``A <seq>`` (after the OK, never before).

With ``--scenario replica`` step 4 instead runs the writer for a while, cuts
*one* replica's power - SIGKILL of its process, then its disk switched to
dm-flakey ``drop_writes`` so the page cache it left dirty never reaches the
disk (unmounting writes it back into the void), then the disk remounted as
the cut left it - while the other two keep serving the writer, restarts the
cut replica, checks again and powers off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvdir.core.client import DirectoryClient, DirectoryError, lookup_request, namespace
from kvdir.core.wire import namespace_key
from kvdir.directory import backup
from kvdir.local import LocalCluster, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb

REPLICAS = ("r1", "r2", "r3")
DEVICES = {"r1": "/dev/vda", "r2": "/dev/vdb", "r3": "/dev/vdc"}
DATA = Path("/data")
NS = namespace("powercut", 16)
NODE = "powercut-writer"
INCARNATION = 1
LEASE_MS = 600_000
HEARTBEAT_S = 5.0
WRITERS = 4
SEQ_BOOT_STRIDE = 10_000_000
"""Writes of boot b are numbered b * stride + ...: unique across boots without state."""
SEQ_WRITER_STRIDE = 1_000_000
WRITING_AGAIN = "C WRITING AGAIN"
"""Said when the second writer starts (tests/powercut/run.py waits for it)."""
SEQ_PHASE_STRIDE = 5_000_000
"""A boot's second writer (after a single-replica cut) numbers from here: WRITERS
strides of the first writer stay below it."""
LOOKUP_CHAINS = 64
LOOKUP_TIMEOUT_S = 120.0
"""One LookupBatch under emulation (a 256-chain batch once took over 10 s)."""
START_TIMEOUT_S = 1800.0
CONVERGE_TIMEOUT_S = 1800.0
WRITE_TIMEOUT_S = 30.0
BLOCK_BYTES = 4096


def sh(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p.stdout


def block(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class Port:
    """The acknowledgement serial port: one os.write per line, so lines never interleave."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
        tty.setraw(self.fd, termios.TCSANOW)
        self.lock = threading.Lock()

    def say(self, line: str) -> None:
        data = (line + "\n").encode()
        with self.lock:
            while data:
                data = data[os.write(self.fd, data) :]


# ------------------------------------------------------------------ disks


def table_linear(name: str) -> str:
    sectors = sh("blockdev", "--getsz", DEVICES[name]).strip()
    return f"0 {sectors} linear {DEVICES[name]} 0"


def mount(name: str) -> None:
    (DATA / name).mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "ext4", f"/dev/mapper/kvdir-{name}", str(DATA / name))


def mount_disks() -> None:
    for name in REPLICAS:
        sh("dmsetup", "create", "--noudevsync", f"kvdir-{name}", "--table", table_linear(name))
    sh("dmsetup", "mknodes")  # no udev in the guest: make /dev/mapper/* ourselves
    for name in REPLICAS:
        mount(name)


def swap_table(name: str, table: str) -> None:
    """Replace a dm device's table without freezing the filesystem (no sync on suspend)."""
    sh("dmsetup", "load", f"kvdir-{name}", "--table", table)
    sh("dmsetup", "suspend", "--noudevsync", "--nolockfs", f"kvdir-{name}")
    sh("dmsetup", "resume", "--noudevsync", f"kvdir-{name}")


def cut_disk(name: str) -> None:
    """Everything not yet on `name`'s disk is lost, as in a power cut of that disk alone."""
    sectors = sh("blockdev", "--getsz", DEVICES[name]).strip()
    swap_table(name, f"0 {sectors} flakey {DEVICES[name]} 0 0 1 1 drop_writes")
    sh("umount", str(DATA / name))  # writes the dirty page cache back: dropped
    swap_table(name, table_linear(name))
    sh("blockdev", "--flushbufs", f"/dev/mapper/kvdir-{name}")
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    mount(name)


# ---------------------------------------------------------------- cluster


def cluster(out: Path, boot: int, serve_args: list[str]) -> LocalCluster:
    logs = out / "logs" / f"boot-{boot}"
    logs.mkdir(parents=True, exist_ok=True)
    c = LocalCluster(str(DATA), size=0, extra_args=serve_args)
    for i, name in enumerate(REPLICAS):
        c.replicas.append(
            Replica(
                name,
                f"127.0.0.1:{7001 + i}",
                f"127.0.0.1:{7101 + i}",
                f"127.0.0.1:{7201 + i}",
                str(DATA / name / "data"),
                str(logs / f"{name}.log"),
            )
        )
    c.size = len(REPLICAS)
    return c


def statuses(c: LocalCluster) -> dict[str, pb.ClusterStatusResponse]:
    out: dict[str, pb.ClusterStatusResponse] = {}
    with DirectoryClient(c.grpc_addresses, timeout_s=2.0) as client:
        for r in c.replicas:
            with contextlib.suppress(DirectoryError):
                out[r.replica_id] = client.call(
                    "ClusterStatus",
                    pb.ClusterStatusRequest(with_digest=True),
                    address=r.grpc_address,
                )
    return out


def converge(c: LocalCluster, need: int) -> dict[str, Any]:
    """Wait until every replica applied the same index (>= need) with the same digest."""
    seen: dict[str, Any] = {}

    def agreed() -> bool:
        st = statuses(c)
        if len(st) < len(REPLICAS):
            return False
        applied = {s.applied_index for s in st.values()}
        digests = {s.state_digest for s in st.values()}
        commits = {s.commit_index for s in st.values()}
        seen.update(
            applied={k: s.applied_index for k, s in st.items()},
            terms={k: s.term for k, s in st.items()},
            digest=next(iter(digests)).hex() if len(digests) == 1 else "",
        )
        return (
            len(applied) == 1 and len(digests) == 1 and applied == commits and min(applied) >= need
        )

    wait_for(agreed, CONVERGE_TIMEOUT_S, "all replicas at one applied index and digest", 0.2)
    return seen


def present_online(c: LocalCluster, seqs: list[int]) -> dict[str, list[int]]:
    """Acknowledged writes each replica's table lacks (local reads, after `converge`)."""
    missing: dict[str, list[int]] = {}
    with DirectoryClient(c.grpc_addresses, timeout_s=LOOKUP_TIMEOUT_S) as client:
        for r in c.replicas:
            lacking: list[int] = []
            for i in range(0, len(seqs), LOOKUP_CHAINS):
                part = seqs[i : i + LOOKUP_CHAINS]
                reqs = [lookup_request(NS, [block(s)], omit_records=True) for s in part]
                resp = client.lookup_batch(reqs, address=r.grpc_address)
                lacking += [s for s, res in zip(part, resp.results, strict=True) if not res.matches]
            missing[r.replica_id] = lacking
    return missing


def present_offline(seqs: list[int]) -> dict[str, Any]:
    """Per replica: acknowledged writes its durable files lack, read without starting it."""
    key = namespace_key(NS)
    out: dict[str, Any] = {}
    for name in REPLICAS:
        try:
            state = backup.recover_state(str(DATA / name / "data"))
        except backup.BackupError as e:
            out[name] = {"error": str(e)}
            continue
        lacking = [s for s in seqs if not state.table.lookup(key, [block(s)], 1, "")]
        out[name] = {"missing": lacking, "index": state.index, "term": state.term}
    return out


# ----------------------------------------------------------------- writer


class Writer:
    """WRITERS threads publishing one block each, reporting every OK on the port."""

    def __init__(self, c: LocalCluster, port: Port, boot: int, phase: int = 0) -> None:
        self.c, self.port, self.boot, self.phase = c, port, boot, phase
        self.stop = threading.Event()
        self.acked: list[int] = []
        self.failed = 0
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(WRITERS)
        ]
        self.threads.append(threading.Thread(target=self._heartbeat, daemon=True))

    def start(self) -> None:
        with DirectoryClient(self.c.grpc_addresses, timeout_s=30.0) as client:
            client.register_node(NODE, "powercut", INCARNATION, "powercut:1", lease_ms=LEASE_MS)
        for t in self.threads:
            t.start()

    def _heartbeat(self) -> None:
        with DirectoryClient(self.c.grpc_addresses, timeout_s=WRITE_TIMEOUT_S) as client:
            while not self.stop.wait(HEARTBEAT_S):
                with contextlib.suppress(DirectoryError):
                    client.heartbeat(NODE, INCARNATION)

    def _run(self, w: int) -> None:
        seq = self.boot * SEQ_BOOT_STRIDE + self.phase * SEQ_PHASE_STRIDE + w * SEQ_WRITER_STRIDE
        with DirectoryClient(self.c.grpc_addresses, timeout_s=WRITE_TIMEOUT_S) as client:
            while not self.stop.is_set():
                seq += 1
                try:
                    client.publish(
                        NODE, INCARNATION, NS, pb.TIER_GPU, [block(seq)], [seq], [BLOCK_BYTES],
                        [1], [1],
                    )  # fmt: skip
                except DirectoryError:
                    with self.lock:
                        self.failed += 1
                    continue
                self.port.say(f"A {seq}")
                with self.lock:
                    self.acked.append(seq)

    def finish(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=WRITE_TIMEOUT_S * 3)
        with self.lock:
            return sorted(self.acked)


# ------------------------------------------------------------------- main


def log_cuts(c: LocalCluster) -> dict[str, int]:
    """How many torn tails each replica cut when it opened its journal this boot."""
    out = {}
    for r in c.replicas:
        try:
            text = Path(r.log_path).read_text(errors="replace")
        except OSError:
            text = ""
        out[r.replica_id] = text.count("cut a torn tail")
    return out


def write_report(out: Path, boot: int, report: dict[str, Any]) -> None:
    path = out / f"report-{boot}.json"
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def check(c: LocalCluster, acked: list[int], timed: Callable[[str], None]) -> dict[str, Any]:
    timed("launching")
    c.start(timeout_s=START_TIMEOUT_S)
    timed("leader")
    agreed = converge(c, 0)
    timed("converged")
    return {"converged": agreed, "online_missing": present_online(c, acked), "cuts": log_cuts(c)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--boot", type=int, required=True)
    ap.add_argument("--scenario", choices=("vm", "replica"), default="vm")
    ap.add_argument("--final", action="store_true", help="check only, then power off")
    ap.add_argument("--writes", type=int, default=500, help="replica scenario: acks per step")
    ap.add_argument(
        "--then-write",
        action="store_true",
        help="replica scenario: afterwards write again until the host pulls the power",
    )
    ap.add_argument("--serve-arg", action="append", default=[])
    args = ap.parse_args(argv)
    out = Path(args.out)
    port = Port("/dev/ttyS1")
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def timed(step: str) -> None:
        timings[step] = round(time.monotonic() - t0, 2)
        port.say(f"C {step} {timings[step]}")

    mount_disks()
    acked_file = out / "acked.txt"
    acked = sorted(int(x) for x in acked_file.read_text().split()) if acked_file.exists() else []
    report: dict[str, Any] = {"boot": args.boot, "acked_before": len(acked), "timings": timings}
    if (DATA / "r1" / "data").exists():
        report["offline"] = present_offline(acked)
        timed("offline")
    c = cluster(out, args.boot, args.serve_arg)
    try:
        report.update(check(c, acked, timed))
        write_report(out, args.boot, report)
        port.say("C CHECKED")
        if args.final:
            return 0
        writer = Writer(c, port, args.boot)
        writer.start()
        port.say("C WRITING")
        if args.scenario == "vm":
            threading.Event().wait()  # until the host pulls the power
        report["replica_cut"] = cut_one(c, writer, args.writes, timed)
        write_report(out, args.boot, report)
        port.say("C DONE")
        if args.then_write:
            Writer(c, port, args.boot, phase=1).start()
            port.say(WRITING_AGAIN)
            threading.Event().wait()  # until the host pulls the power
        return 0
    finally:
        c.stop()


def acked_more(writer: Writer, n: int) -> None:
    start = len(writer.acked)
    wait_for(lambda: len(writer.acked) >= start + n, CONVERGE_TIMEOUT_S, f"{n} more acks", 0.05)


def cut_one(
    c: LocalCluster, writer: Writer, writes: int, timed: Callable[[str], None]
) -> dict[str, Any]:
    """Cut one follower's power while the writer goes on; restart it; check everything."""
    acked_more(writer, writes)
    leader = c.wait_leader(30.0)
    victim = next(r for r in c.replicas if r is not leader)
    acked_at_cut = len(writer.acked)
    c.kill(victim)
    cut_disk(victim.replica_id)
    timed("replica_cut")
    offline = present_offline(sorted(writer.acked))[victim.replica_id]
    acked_more(writer, writes)  # the other two keep committing without it
    c.launch(victim)
    acked_more(writer, writes)  # and with it, catching up
    acked = writer.finish()
    timed("writer_stopped")
    agreed = converge(c, 0)
    timed("reconverged")
    return {
        "victim": victim.replica_id,
        "acked_at_cut": acked_at_cut,
        "acked": len(acked),
        "failed_writes": writer.failed,
        "victim_offline_index": offline.get("index"),
        "converged": agreed,
        "online_missing": present_online(c, acked),
        "cuts": log_cuts(c),
    }


if __name__ == "__main__":
    sys.exit(main())
