"""Runs INSIDE the systemd VM, as root, with kvdir installed from its wheel.

tests/deploy/test_systemd_vm.py copies this file into the VM and runs it with
/opt/kvdir/venv/bin/python (the venv the wheel went into; the repository is
not shared with the guest, so every kvdir import comes from the wheel).
It drives the shipped units through systemctl and checks, each step bounded:

1. the three directory replicas and the agent start (`systemctl enable
   --now`, whose start jobs finish only after the units' `kvdir ctl
   wait-ready` gate) and are active;
2. an engine stores a chain in the agent's pool; `kvdir ctl lookup` on each
   replica finds it;
3. the leader is killed with `systemctl kill --signal=SIGKILL`: systemd
   restarts it (NRestarts + 1, a new MainPID), the others elect a leader in a
   later term, and every replica, the restarted one included, still answers
   the lookup;
4. `systemctl stop` of the (new) leader is graceful: the unit ends with
   Result=success, its journal says it handed leadership over, a leader is
   elected, and after `systemctl start` it rejoins and answers.

The outcome goes to OUT/report.json (steps with seconds, and an error if one
failed); the exit status is 0 only when every check held.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, DirectoryError, namespace
from kvdir.core.hashing import block_chain
from kvdir.v1 import directory_pb2 as pb

T = TypeVar("T")

KVDIR = "/opt/kvdir/venv/bin/kvdir"
REPLICAS = ("r1", "r2", "r3")
GRPC = {r: f"127.0.0.1:{7101 + i}" for i, r in enumerate(REPLICAS)}
AGENT_UNIT = "kvdir-agent.service"
AGENT_SOCKET = "/run/kvdir/agent.sock"
AGENT_METRICS = "127.0.0.1:7302"
NODE_ID = "vm-node"
MODEL = "vm-model"
BLOCK_TOKENS = 16
BLOCKS = 4
START_TIMEOUT_S = 500.0
"""Starting the units under emulation (TCG): imports alone take 10-60 s per process."""
STEP_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 180.0
"""One command (`kvdir ctl`, systemctl): a Python CLI's imports alone took over 60 s
under TCG while the rest of the suite ran beside the VM (a fresh-clone CI run)."""
POLL_S = 0.5


class CheckFailed(Exception):
    pass


def unit(replica: str) -> str:
    return f"kvdir-directory@{replica}.service"


def sh(*cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{' '.join(cmd)} took over {timeout_s:.0f}s") from e
    if check and p.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-1500:]}")
    return p.stdout


def sh_all(argv: dict[str, list[str]], timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, str]:
    """`sh` of several commands at once (one deadline for all); key -> stdout."""
    procs: dict[str, subprocess.Popen[str]] = {}
    deadline = time.monotonic() + timeout_s
    outs: dict[str, str] = {}
    try:
        for k, cmd in argv.items():
            procs[k] = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        for k, p in procs.items():
            try:
                out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise CheckFailed(f"{' '.join(argv[k])} took over {timeout_s:.0f}s") from e
            if p.returncode != 0:
                raise CheckFailed(
                    f"{' '.join(argv[k])} failed ({p.returncode}): {err.strip()[-1500:]}"
                )
            outs[k] = out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def show(name: str) -> dict[str, str]:
    props = "MainPID,NRestarts,ActiveState,SubState,Result,ExecMainStatus"
    out = sh("systemctl", "show", name, "-p", props)
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            got = probe()
            if got is not None:
                return got
        except CheckFailed as e:
            last_error = str(e)
        if time.monotonic() >= deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f}s waiting for {what} {last_error}")
        time.sleep(POLL_S)


# Polling goes through one in-process client: every `kvdir ctl` run is a fresh
# Python start (seconds under emulation). The CLI is run at the checkpoints.
CLIENT = DirectoryClient(list(GRPC.values()), timeout_s=3.0)
NS = namespace(MODEL, BLOCK_TOKENS)


def leader(replicas: list[str], after_term: int = -1) -> tuple[str, int] | None:
    """(leader id, term) once `replicas` all answer and agree on one in a term > after_term."""
    try:
        st = [CLIENT.status(GRPC[r]) for r in replicas]
    except DirectoryError as e:
        raise CheckFailed(f"status: {e}") from e
    leaders = [s for s in st if s.role == pb.ROLE_LEADER]
    if len(leaders) != 1 or leaders[0].term <= after_term:
        return None
    lead = leaders[0].replica_id
    return (lead, int(leaders[0].term)) if all(s.leader_id == lead for s in st) else None


def lookups_answer(replicas: list[str], hashes: list[bytes]) -> dict[str, int] | None:
    """Replica -> blocks of the chain it says NODE_ID holds, once each says all of them."""
    got = {}
    for r in replicas:
        try:
            resp = CLIENT.lookup(NS, hashes, address=GRPC[r])
        except DirectoryError as e:
            raise CheckFailed(f"lookup on {r}: {e}") from e
        got[r] = max((m.prefix_blocks for m in resp.matches if m.node_id == NODE_ID), default=0)
    return got if all(n == len(hashes) for n in got.values()) else None


def cli_lookup(replicas: list[str], hashes: list[bytes]) -> dict[str, int]:
    """`kvdir ctl lookup` against each replica: what an operator would type.

    The runs go at once: each is a fresh Python start (5-20 s emulated), and the
    guest has two vCPUs."""
    argv = {
        r: [
            KVDIR,
            *("ctl", "lookup", "--addr", GRPC[r], "--timeout", "10", "--json"),
            *("--model", MODEL, "--block-tokens", str(BLOCK_TOKENS)),
            *("--hashes", ",".join(h.hex() for h in hashes)),
        ]
        for r in replicas
    }
    outs = sh_all(argv)
    got = {}
    for r, out in outs.items():
        matches = json.loads(out).get("matches", [])
        got[r] = max(
            (int(m.get("prefix_blocks", 0)) for m in matches if m.get("node_id") == NODE_ID),
            default=0,
        )
    if any(n != len(hashes) for n in got.values()):
        raise CheckFailed(f"kvdir ctl lookup did not find the chain everywhere: {got}")
    return got


def cli_until_found(replicas: list[str], hashes: list[bytes]) -> dict[str, int]:
    """`cli_lookup`, asked again until it answers: one run may meet an election (a
    CLI's deadline is seconds, a starved replica's stall can be as long)."""
    return wait(lambda: cli_lookup(replicas, hashes), STEP_TIMEOUT_S, "kvdir ctl lookup")


def all_active(units: list[str]) -> bool:
    return all(sh("systemctl", "is-active", u, check=False).strip() == "active" for u in units)


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.report: dict[str, Any] = {"steps": [], "ok": False}
        self.t0 = time.monotonic()

    def step(self, name: str, **details: Any) -> None:
        entry = {"step": name, "at_s": round(time.monotonic() - self.t0, 1), **details}
        self.report["steps"].append(entry)
        print(json.dumps(entry), flush=True)
        self.save()

    def save(self) -> None:
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2))


def store_chain() -> list[bytes]:
    """What an engine does after a prefill: write KV into pool slots, announce them."""
    ns = NS
    hashes = block_chain(list(range(BLOCKS * BLOCK_TOKENS)), BLOCK_TOKENS)
    engine = EngineClient(AGENT_SOCKET, timeout_s=30)
    try:
        slots = engine.allocate(ns, BLOCKS).slots
        rng = random.Random(7)
        for s in slots:
            view = engine.slot_view(ns, s)
            view[:] = rng.randbytes(len(view))
        engine.stored(ns, hashes, slots)
        engine.flush()
    finally:
        engine.close()
    return hashes


def scenario(run: Run) -> None:
    import kvdir.agent  # which kvdir this is: the wheel's, in the venv the units run

    run.step(
        "installed",
        package=str(Path(kvdir.agent.__file__).resolve().parent),
        version=importlib.metadata.version("kvdir"),
    )
    directories = [unit(r) for r in REPLICAS]
    t = time.monotonic()
    sh("systemctl", "enable", "--now", *directories, timeout_s=START_TIMEOUT_S)
    if not all_active(directories):
        raise CheckFailed(f"directory units not active: {[show(u) for u in directories]}")
    run.step("directories_active", seconds=round(time.monotonic() - t, 1))

    t = time.monotonic()
    sh("systemctl", "enable", "--now", AGENT_UNIT, timeout_s=START_TIMEOUT_S)
    if not all_active([AGENT_UNIT]):
        raise CheckFailed(f"agent unit not active: {show(AGENT_UNIT)}")
    agent_pid = show(AGENT_UNIT)["MainPID"]
    run.step("agent_active", seconds=round(time.monotonic() - t, 1))

    with urllib.request.urlopen(f"http://{AGENT_METRICS}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    rdma_lines = [ln for ln in metrics.splitlines() if ln.startswith("kvdir_agent_rdma_errors")]
    if not rdma_lines:
        raise CheckFailed("the installed agent exports no kvdir_agent_rdma_errors_total")
    run.step("agent_metrics", rdma_errors_series=len(rdma_lines))

    hashes = store_chain()
    got = wait(
        lambda: lookups_answer(list(REPLICAS), hashes),
        STEP_TIMEOUT_S,
        "every replica's lookup to find the stored chain",
    )
    run.step("lookup_answers", prefix_blocks=got, cli=cli_until_found(list(REPLICAS), hashes))

    first, term1 = wait(lambda: leader(list(REPLICAS)), STEP_TIMEOUT_S, "an agreed leader")
    before = show(unit(first))
    run.step("leader", replica=first, term=term1, main_pid=before["MainPID"])

    t = time.monotonic()
    sh("systemctl", "kill", "--signal=SIGKILL", unit(first))

    def restarted() -> dict[str, str] | None:
        now = show(unit(first))
        ok = (
            int(now["NRestarts"]) == int(before["NRestarts"]) + 1
            and now["MainPID"] not in ("0", before["MainPID"])
            and now["ActiveState"] == "active"
        )
        return now if ok else None

    after = wait(restarted, STEP_TIMEOUT_S, f"systemd to restart {unit(first)}")
    run.step(
        "killed_leader_restarted",
        seconds=round(time.monotonic() - t, 1),
        n_restarts=after["NRestarts"],
        main_pid=after["MainPID"],
    )
    second, term2 = wait(
        lambda: leader(list(REPLICAS), after_term=term1),
        STEP_TIMEOUT_S,
        "a leader in a later term, agreed by all three",
    )
    run.step("new_leader", replica=second, term=term2, seconds=round(time.monotonic() - t, 1))
    got = wait(
        lambda: lookups_answer(list(REPLICAS), hashes),
        STEP_TIMEOUT_S,
        "every replica (the restarted one too) to answer the lookup after the kill",
    )
    run.step("lookup_after_kill", prefix_blocks=got, cli=cli_until_found(list(REPLICAS), hashes))

    # The leader to stop is the one in office now: a starved replica may have been
    # deposed since `new_leader` (the handover is asked of a leader, not of a name).
    second, term2 = wait(
        lambda: leader(list(REPLICAS), after_term=term2 - 1),
        STEP_TIMEOUT_S,
        "the leader in office before the graceful stop",
    )
    t = time.monotonic()
    sh("systemctl", "stop", unit(second), timeout_s=STEP_TIMEOUT_S)
    stopped = show(unit(second))
    if stopped["ActiveState"] != "inactive" or stopped["Result"] != "success":
        raise CheckFailed(f"graceful stop of {unit(second)} did not end cleanly: {stopped}")
    journal = sh("journalctl", "-u", unit(second), "-o", "cat", "--no-pager")
    if "leadership handed over" not in journal:
        raise CheckFailed(f"{unit(second)} did not hand leadership over:\n{journal[-3000:]}")
    others = [r for r in REPLICAS if r != second]
    third, term3 = wait(
        lambda: leader(others, after_term=term2),
        STEP_TIMEOUT_S,
        "a leader among the other two after the graceful stop",
    )
    run.step(
        "graceful_stop_handed_over",
        stopped=second,
        result=stopped["Result"],
        leader=third,
        term=term3,
        seconds=round(time.monotonic() - t, 1),
    )
    got = wait(lambda: lookups_answer(others, hashes), STEP_TIMEOUT_S, "lookups on two replicas")
    run.step("lookup_after_stop", prefix_blocks=got)

    sh("systemctl", "start", unit(second), timeout_s=START_TIMEOUT_S)
    got = wait(
        lambda: lookups_answer(list(REPLICAS), hashes), STEP_TIMEOUT_S, "the rejoined replica"
    )
    agent_now = show(AGENT_UNIT)
    if agent_now["ActiveState"] != "active" or agent_now["MainPID"] != agent_pid:
        raise CheckFailed(f"the agent did not ride through the leader changes: {agent_now}")
    run.step("rejoined", replica=second, prefix_blocks=got, agent=agent_now["ActiveState"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    run = Run(out)
    try:
        scenario(run)
    except (CheckFailed, OSError, ValueError, KeyError) as e:
        run.report["error"] = f"{type(e).__name__}: {e}"
        run.report["units"] = {
            u: show(u) for u in [*(unit(r) for r in REPLICAS), AGENT_UNIT] if _quiet_show(u)
        }
        run.save()
        print(run.report["error"], flush=True)
        return 1
    run.report["ok"] = True
    run.report["seconds"] = round(time.monotonic() - run.t0, 1)
    run.save()
    return 0


def _quiet_show(name: str) -> bool:
    try:
        show(name)
    except CheckFailed:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
