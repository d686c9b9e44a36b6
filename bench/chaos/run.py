"""`kvdir chaos`: a directory under a schedule of faults, a recorded history, a verdict.

Two processes. The outer one (`run`, in the caller's namespace, as root)
creates the namespaces, starts the inner one inside the client namespace,
and whatever happens removes the namespaces again and kills anything left in
them; then it checks the history (`bench.chaos.checker`) and writes the
figures. The inner one (`Orchestrator`) starts the replicas, the workload
processes and injects the faults, one at a time, each followed by a wait
until the cluster is whole again.

Faults (docs/chaos.md):

- ``kill-leader``: SIGKILL the leader, restart it from its journal.
- ``pause-leader``: SIGSTOP the leader past the election timeout, SIGCONT;
  right after resuming it must not serve a linearizable read as leader.
- ``partition-leader``: cut the leader off from every other replica (clients
  still reach it; it must not acknowledge a write or a linearizable read).
- ``partition-minority``: cut a minority of followers off from the rest.
- ``restart-all``: SIGKILL every replica, restart all from their journals.
- ``agent-crash``: SIGKILL an agent with a short lease; its entries must
  vanish within the lease plus one election.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.chaos import checker, history, netns, workload
from bench.chaos.cluster import NetCluster
from bench.chaos.history import Event, Fault, Op, Recorder
from kvdir.local import ClusterError, Replica, wait_for
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

FAULT_KINDS = (
    "kill-leader",
    "pause-leader",
    "partition-leader",
    "partition-minority",
    "agent-crash",
    "restart-all",
)
WEIGHTS = {
    "kill-leader": 30,
    "pause-leader": 15,
    "partition-leader": 15,
    "partition-minority": 15,
    "agent-crash": 20,
    "restart-all": 5,
}
PAUSE_S = 1.0
"""SIGSTOP length: > 3 election timeouts (0.15-0.3 s)."""
PARTITION_S = 2.0
"""Longer than leader_fallback_s (1 s), so a cut-off leader steps down."""
SETTLE_S = 0.5
"""Load between faults (so each fault hits a loaded, whole cluster)."""
RECOVER_S = 45.0
LEADER_S = 30.0
CRASH_LEASE_MS = 1500
SWEEP_MS = 250  # DirectoryConfig.lease_sweep_ms default
ELECTION_ALLOWANCE_S = 1.0
"""'One election' in the lease bound: the 0.15-0.3 s timeout plus campaign and commit."""
PROBE_OWNER = 999
FINAL_READ_S = 60.0
CONVERGE_S = 60.0
INNER_TIMEOUT_SLACK_S = 600.0


@dataclass
class ChaosConfig:
    out: str
    replicas: int = 3
    faults: int = 10
    seed: int = 1
    agents: int = 4
    keys: int = 16
    lin_readers: int = 2
    mirrors: int = 1
    """Readers of a client-side mirror (kvdir.core.mirror) fed over Watch."""
    pace_ms: float = 20.0
    kinds: tuple[str, ...] = FAULT_KINDS
    max_seconds: float = 1800.0

    def check(self) -> None:
        if self.replicas not in (3, 5):
            raise ValueError("--replicas must be 3 or 5")
        if self.faults < 1:
            raise ValueError("--faults must be >= 1")
        bad = sorted(set(self.kinds) - set(FAULT_KINDS))
        if bad:
            raise ValueError(f"unknown fault kinds: {', '.join(bad)}")
        if not (1 <= self.agents <= 64 and 1 <= self.keys <= 1024):
            raise ValueError("--agents must be 1..64 and --keys 1..1024")


def schedule(cfg: ChaosConfig) -> list[str]:
    """Every kind once (in order), then weighted random picks, `cfg.faults` in all."""
    rng = random.Random(cfg.seed)
    kinds = list(cfg.kinds)
    out = kinds[: cfg.faults]
    weights = [WEIGHTS[k] for k in kinds]
    while len(out) < cfg.faults:
        out.append(rng.choices(kinds, weights)[0])
    return out


# ----------------------------------------------------------------- inner


class Orchestrator:
    """Runs inside the client namespace: replicas, workload, faults, final state."""

    def __init__(self, cfg: ChaosConfig, plan: dict[str, Any]) -> None:
        self.cfg = cfg
        self.plan = plan
        self.out = Path(cfg.out)
        self.rng = random.Random(cfg.seed + 1)
        self._f = open(self.out / "orchestrator.jsonl", "a")  # noqa: SIM115 (closed in close())
        self._rec = Recorder(self._f)
        self._lock = threading.Lock()
        self.cluster = NetCluster(
            str(self.out / "replicas"),
            size=cfg.replicas,
            ips={r: plan["ips"][r] for r in plan["replicas"]},
            prefixes={r: ["ip", "netns", "exec", plan["ns"][r]] for r in plan["replicas"]},
            record=self.record,
        )
        self.addresses = self.cluster.grpc_addresses
        self.channels = {a: grpc.insecure_channel(a) for a in self.addresses}
        self.stubs = {a: pb_grpc.PrefixDirectoryStub(c) for a, c in self.channels.items()}
        self.workers: list[subprocess.Popen[bytes]] = []
        self.crash_index = 0
        self.probe_gen = 0
        self.caller = workload.Caller(self.addresses, random.Random(cfg.seed + 2))

    def record(self, r: Op | Fault | Event) -> None:
        with self._lock:
            self._rec(r)

    def log(self, msg: str) -> None:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # ------------------------------------------------------------ cluster

    def status(
        self, r: Replica, timeout_s: float = 0.5, digest: bool = False
    ) -> pb.ClusterStatusResponse | None:
        if not r.alive:
            return None
        try:
            resp: pb.ClusterStatusResponse = self.stubs[r.grpc_address].ClusterStatus(
                pb.ClusterStatusRequest(with_digest=digest), timeout=timeout_s
            )
            return resp
        except grpc.RpcError:
            return None

    def leader_among(self, members: Sequence[Replica]) -> Replica | None:
        """The replica of `members` that leads and that a majority of the cluster follows."""
        st = {r.replica_id: s for r in members if (s := self.status(r)) is not None}
        leaders = [rid for rid, s in st.items() if s.role == pb.ROLE_LEADER]
        if len(leaders) != 1:
            return None
        agreed = sum(1 for s in st.values() if s.leader_id == leaders[0])
        if agreed * 2 <= self.cfg.replicas:
            return None
        return self.cluster.by_id(leaders[0])

    def wait_leader(self, members: Sequence[Replica], timeout_s: float = LEADER_S) -> Replica:
        found: list[Replica] = []

        def has() -> bool:
            r = self.leader_among(members)
            if r is not None:
                found.append(r)
            return r is not None

        wait_for(has, timeout_s, "a leader a majority follows", 0.02)
        return found[-1]

    def whole(self) -> bool:
        """Every replica alive, answering, following one leader."""
        st = [self.status(r) for r in self.cluster.replicas]
        if any(s is None for s in st):
            return False
        leaders = {s.leader_id for s in st if s is not None}
        return (
            len(leaders) == 1
            and "" not in leaders
            and sum(1 for s in st if s is not None and s.role == pb.ROLE_LEADER) == 1
        )

    def wait_whole(self, timeout_s: float = RECOVER_S) -> float:
        """When the cluster was whole again (0.0 when it was not within `timeout_s`)."""
        try:
            wait_for(self.whole, timeout_s, "the whole cluster to follow one leader", 0.05)
        except ClusterError as e:
            self.log(str(e))
            return 0.0
        return time.monotonic()

    # ------------------------------------------------------------ workload

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.out / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        p = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos.workload", *args],
            stdout=subprocess.PIPE if name.startswith("crash") else log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        return p

    def start_workload(self) -> None:
        addrs = ",".join(self.addresses)
        common = [
            "--addresses",
            addrs,
            "--agents",
            str(self.cfg.agents),
            "--keys",
            str(self.cfg.keys),
        ]
        common += ["--pace-ms", str(self.cfg.pace_ms), "--seed", str(self.cfg.seed)]
        common += ["--max-seconds", str(self.cfg.max_seconds)]
        self.workers.append(
            self.spawn(["agents", *common, "--out", str(self.out / "agents.jsonl")], "agents")
        )
        local = [f"--replica={r.replica_id}={r.grpc_address}" for r in self.cluster.replicas]
        self.workers.append(
            self.spawn(
                [
                    *("readers", *common, "--lin-readers", str(self.cfg.lin_readers), *local),
                    *("--mirrors", str(self.cfg.mirrors)),
                    *("--out", str(self.out / "readers.jsonl")),
                ],
                "readers",
            )
        )

    def stop_workload(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.workers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.workers.clear()

    def acked_writes(self) -> int:
        path = self.out / "agents.jsonl"
        if not path.exists():
            return 0
        with open(path) as f:
            return sum(1 for line in f if '"outcome":"ok"' in line)

    # ------------------------------------------------------------ probes

    def probe(
        self, r: Replica, deadline_s: float = 1.0
    ) -> tuple[str, pb.LookupBatchResponse | None]:
        """One write and one linearizable read of the probe key, pinned to `r` (recorded)."""
        key = (PROBE_OWNER, 0)
        self.probe_gen += 1
        gen = self.probe_gen
        t0 = time.monotonic()
        out, resp, last, _ = self.caller.call(
            "Publish", workload.publish_req(*key, 1, gen), deadline_s, pinned=r.grpc_address
        )
        t1 = time.monotonic()
        self.record(
            Op(
                "probe",
                "publish",
                workload.key_name(*key),
                t0,
                t1,
                out,
                value=gen,
                result=None
                if resp is None or self.caller.retried_maybe
                else int(resp.applied == 1),
                last_attempt=last,
            )
        )
        req = pb.LookupBatchRequest(
            lookups=[
                pb.LookupRequest(namespace=workload.SPACE, block_hashes=[workload.block_hash(*key)])
            ],
            linearizable=True,
        )
        t0 = time.monotonic()
        rout, rresp, last, _ = self.caller.call(
            "LookupBatch", req, deadline_s, pinned=r.grpc_address
        )
        t1 = time.monotonic()
        value, bad = (None, "")
        if rresp is not None:
            value, bad = workload.decode_match(*key, rresp.results[0].matches)
            self.record(
                Op(
                    "probe",
                    "read",
                    workload.key_name(*key),
                    t0,
                    t1,
                    "ok",
                    value=value,
                    mode="lin",
                    replica=rresp.read.replica_id,
                    applied_index=rresp.read.applied_index,
                    role=rresp.read.role,
                    last_attempt=last,
                    bad_record=bad,
                )
            )
        return f"write {out}, linearizable read {rout}", rresp

    def register_probe(self) -> None:
        stop = workload.Stop(threading.Event(), time.monotonic() + LEADER_S)
        if not workload.register(self.caller, PROBE_OWNER, 1, workload.LIVE_LEASE_MS, stop):
            raise ClusterError("could not register the probe node")

    # ------------------------------------------------------------ faults

    def others(self, r: Replica) -> list[Replica]:
        return [x for x in self.cluster.replicas if x is not r]

    def fault_kill_leader(self) -> Fault:
        leader = self.wait_leader(self.cluster.replicas)
        t = time.monotonic()
        self.cluster.kill(leader, signal.SIGKILL)
        new = self.wait_leader(self.others(leader))
        elected = time.monotonic() - t
        end = time.monotonic()
        self.cluster.launch(leader)
        return Fault(
            "kill-leader",
            t,
            end,
            leader.replica_id,
            self.wait_whole(),
            {"new_leader": new.replica_id, "elected_s": round(elected, 4)},
        )

    def fault_pause_leader(self) -> Fault:
        leader = self.wait_leader(self.cluster.replicas)
        t = time.monotonic()
        self.cluster.pause(leader)
        try:
            new = self.wait_leader(self.others(leader))
            elected = time.monotonic() - t
            time.sleep(max(0.0, t + PAUSE_S - time.monotonic()))  # the fault's length, not a wait
        finally:
            self.cluster.resume(leader)
        end = time.monotonic()
        what, resp = self.probe(leader, deadline_s=0.5)
        if (
            resp is not None
            and resp.read.replica_id == leader.replica_id
            and resp.read.role == pb.ROLE_LEADER
            and time.monotonic() - end < 0.1
        ):
            self.record(
                Event("stale-leader-served", end, {"replica": leader.replica_id, "after": "resume"})
            )
        return Fault(
            "pause-leader",
            t,
            end,
            leader.replica_id,
            self.wait_whole(),
            {"new_leader": new.replica_id, "elected_s": round(elected, 4), "probe": what},
        )

    def fault_partition_leader(self) -> Fault:
        leader = self.wait_leader(self.cluster.replicas)
        net = self.plan_net()
        others = self.others(leader)
        net.partition([leader.replica_id], [r.replica_id for r in others])
        t = time.monotonic()  # once every rule is in place
        try:
            # While it may still believe it leads (before leader_fallback_s), it must not
            # acknowledge anything: it cannot reach a majority.
            what, _ = self.probe(leader, deadline_s=0.5)
            if "write ok" in what or "read ok" in what:
                self.record(
                    Event(
                        "stale-leader-served",
                        time.monotonic(),
                        {"replica": leader.replica_id, "after": "isolation", "probe": what},
                    )
                )
            new = self.wait_leader(others)
            elected = time.monotonic() - t
            time.sleep(max(0.0, t + PARTITION_S - time.monotonic()))
        finally:
            net.heal()
        end = time.monotonic()
        return Fault(
            "partition-leader",
            t,
            end,
            leader.replica_id,
            self.wait_whole(),
            {"new_leader": new.replica_id, "elected_s": round(elected, 4), "probe": what},
        )

    def fault_partition_minority(self) -> Fault:
        leader = self.wait_leader(self.cluster.replicas)
        followers = self.others(leader)
        minority = self.rng.sample(followers, (self.cfg.replicas - 1) // 2)
        rest = [r for r in self.cluster.replicas if r not in minority]
        net = self.plan_net()
        net.partition([r.replica_id for r in minority], [r.replica_id for r in rest])
        t = time.monotonic()  # once every rule is in place
        try:
            what, _ = self.probe(minority[0], deadline_s=0.5)
            if "read ok" in what:
                self.record(
                    Event(
                        "stale-leader-served",
                        time.monotonic(),
                        {"replica": minority[0].replica_id, "after": "minority", "probe": what},
                    )
                )
            time.sleep(max(0.0, t + PARTITION_S - time.monotonic()))
        finally:
            net.heal()
        end = time.monotonic()
        return Fault(
            "partition-minority",
            t,
            end,
            ",".join(r.replica_id for r in minority),
            self.wait_whole(),
            {"probe": what},
        )

    def fault_restart_all(self) -> Fault:
        self.wait_leader(self.cluster.replicas)
        for r in self.cluster.replicas:
            self.cluster.kill(r, signal.SIGKILL)
        t = time.monotonic()  # once no replica is left
        for r in self.cluster.replicas:
            self.cluster.launch(r)
        self.wait_leader(self.cluster.replicas, 60)
        end = time.monotonic()
        return Fault("restart-all", t, end, "all", self.wait_whole())

    def crash_visible(self, index: int, blocks: int) -> int | None:
        """How many of crash agent `index`'s blocks a linearizable lookup shows (None: failed)."""
        owner = 1000 + index
        req = pb.LookupBatchRequest(
            lookups=[
                pb.LookupRequest(
                    namespace=workload.SPACE, block_hashes=[workload.block_hash(owner, k)]
                )
                for k in range(blocks)
            ],
            linearizable=True,
        )
        out, resp, _, _ = self.caller.call("LookupBatch", req, 1.0)
        if out != "ok":
            return None
        node = workload.owner_node(owner)
        return sum(1 for res in resp.results if any(m.node_id == node for m in res.matches))

    def fault_agent_crash(self) -> Fault:
        self.crash_index += 1
        idx, blocks = self.crash_index, 8
        p = self.spawn(
            [
                "crash-agent",
                "--addresses",
                ",".join(self.addresses),
                "--node",
                str(idx),
                "--blocks",
                str(blocks),
                "--lease-ms",
                str(CRASH_LEASE_MS),
                "--out",
                str(self.out / f"crash-{idx}.jsonl"),
                "--max-seconds",
                "300",
            ],
            f"crash-{idx}",
        )
        try:
            assert p.stdout is not None
            ready: list[bytes] = []
            reader = threading.Thread(target=lambda: ready.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
            reader.start()
            reader.join(LEADER_S)
            if not ready or ready[0].strip() != b"ready":
                raise ClusterError(f"crash agent {idx} did not become ready")
            visible = self.crash_visible(idx, blocks)
            leader_before = self.leader_among(self.cluster.replicas)
            t = time.monotonic()
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            gone: list[float] = []

            def vanished() -> bool:
                if self.crash_visible(idx, blocks) == 0:
                    gone.append(time.monotonic())
                    return True
                return False

            with contextlib.suppress(ClusterError):
                wait_for(vanished, 30, f"crash agent {idx}'s entries to vanish", 0.05)
            leader_after = self.leader_among(self.cluster.replicas)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        changed = (
            leader_before is None
            or leader_after is None
            or leader_before.replica_id != leader_after.replica_id
        )
        self.record(
            Event(
                "agent-crash",
                t,
                {
                    "node": workload.owner_node(1000 + idx),
                    "lease_ms": CRASH_LEASE_MS,
                    "sweep_ms": SWEEP_MS,
                    "blocks": blocks,
                    "visible_before": visible,
                    "vanished_at": gone[0] if gone else None,
                    "leader_changed": changed,
                },
            )
        )
        return Fault(
            "agent-crash",
            t,
            t,
            workload.owner_node(1000 + idx),
            gone[0] if gone else 0.0,
            {"visible_before": visible, "vanish_s": round(gone[0] - t, 4) if gone else None},
        )

    def plan_net(self) -> netns.Network:
        net = netns.Network(list(self.plan["members"]), prefix=self.plan["prefix"])
        net.addresses = dict(self.plan["ips"])
        return net

    # ------------------------------------------------------------ the run

    def final_state(self) -> None:
        """A linearizable read of every key (recorded), then every replica's digest."""
        keys = [(o, k) for o in range(self.cfg.agents) for k in range(self.cfg.keys)]
        keys.append((PROBE_OWNER, 0))
        for start in range(0, len(keys), 64):
            part = keys[start : start + 64]
            req = pb.LookupBatchRequest(
                lookups=[
                    pb.LookupRequest(
                        namespace=workload.SPACE, block_hashes=[workload.block_hash(o, k)]
                    )
                    for o, k in part
                ],
                linearizable=True,
            )
            t0 = time.monotonic()
            out, resp, last, err = self.caller.call("LookupBatch", req, FINAL_READ_S)
            t1 = time.monotonic()
            if out != "ok":
                self.log(f"final read failed: {err}")
                continue
            for i, (o, k) in enumerate(part):
                value, bad = workload.decode_match(o, k, resp.results[i].matches)
                self.record(
                    Op(
                        "final",
                        "read",
                        workload.key_name(o, k),
                        t0,
                        t1,
                        "ok",
                        value=value,
                        mode="lin",
                        replica=resp.read.replica_id,
                        applied_index=resp.read.applied_index,
                        last_attempt=last,
                        bad_record=bad,
                    )
                )
                self.record(
                    Event("final-read", t1, {"key": workload.key_name(o, k), "value": value})
                )
        last_seen: dict[str, Any] = {}

        def agree() -> bool:
            st = {r.replica_id: self.status(r, 5.0, digest=True) for r in self.cluster.replicas}
            got = {rid: s for rid, s in st.items() if s is not None}
            last_seen.clear()
            last_seen.update(
                digests={rid: s.state_digest.hex() for rid, s in got.items()},
                applied={rid: s.applied_index for rid, s in got.items()},
                replicas=self.cfg.replicas,
            )
            return (
                len(got) == self.cfg.replicas
                and len({s.applied_index for s in got.values()}) == 1
                and len({s.state_digest for s in got.values()}) == 1
            )

        with contextlib.suppress(ClusterError):
            wait_for(agree, CONVERGE_S, "every replica to report the same state digest", 0.2)
        self.record(Event("convergence", time.monotonic(), last_seen))

    def run(self) -> int:
        cfg = self.cfg
        kinds = schedule(cfg)
        deadline = time.monotonic() + cfg.max_seconds
        self.log(f"{cfg.replicas} replicas, {len(kinds)} faults, out {cfg.out}")
        try:
            self.cluster.start(LEADER_S * 2)
            wait_for(self.whole, RECOVER_S, "all replicas to follow one leader", 0.05)
            self.register_probe()
            self.start_workload()
            wait_for(lambda: self.acked_writes() >= 20, 60, "the workload's first writes", 0.1)
            for n, kind in enumerate(kinds, 1):
                if time.monotonic() >= deadline:
                    self.log(f"time is up after {n - 1} faults")
                    break
                time.sleep(SETTLE_S)  # load on a whole cluster between faults, by design
                try:
                    fault = getattr(self, "fault_" + kind.replace("-", "_"))()
                except ClusterError as e:
                    self.log(f"fault {n} {kind}: {e}")
                    self.record(
                        Event("fault-error", time.monotonic(), {"kind": kind, "error": str(e)})
                    )
                    self.plan_net().heal(everywhere=True)
                    for r in self.cluster.replicas:
                        self.cluster.resume(r)
                        if not r.alive:
                            self.cluster.launch(r)
                    self.wait_whole()
                    continue
                self.record(fault)
                took = (fault.recovered - fault.start) if fault.recovered else None
                self.log(
                    f"fault {n}/{len(kinds)} {kind} {fault.target}: whole again after "
                    f"{'-' if took is None else f'{took:.2f}s'} {fault.detail}"
                )
            time.sleep(SETTLE_S)
            self.stop_workload()
            self.wait_whole()
            self.final_state()
        finally:
            self.stop_workload()
            self.cluster.stop()
            self.caller.close()
            for c in self.channels.values():
                c.close()
            self._f.close()
        return 0


def inner_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.chaos.run")
    p.add_argument("plan")
    a = p.parse_args(argv)
    plan = json.loads(Path(a.plan).read_text())
    cfg = ChaosConfig(**{**plan["config"], "kinds": tuple(plan["config"]["kinds"])})
    return Orchestrator(cfg, plan).run()


# ----------------------------------------------------------------- outer


@dataclass
class Outcome:
    report: checker.Report
    paths: dict[str, str] = field(default_factory=dict)
    inner_rc: int = 0


def _kill_namespace_processes(net: netns.Network) -> None:
    """Kill, by id, every process still inside this run's namespaces (ours, by construction)."""
    for ns in list(net.created):
        p = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20, check=False
        )
        for pid in p.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGCONT)
                os.kill(int(pid), signal.SIGKILL)


def run(cfg: ChaosConfig, stream: Any = None) -> Outcome:
    """Set up the network, run the orchestrator in it, tear down, check, write the figures."""
    cfg.check()
    why = netns.available()
    if why:
        raise RuntimeError(f"kvdir chaos {why}")
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    netns.remove_leftovers()
    replicas = [f"r{i + 1}" for i in range(cfg.replicas)]
    net = netns.Network([*replicas, "client"])
    inner_rc = -1
    net.up()
    try:
        plan = {
            "config": asdict(cfg),
            "prefix": net.prefix,
            "members": net.members,
            "replicas": replicas,
            "ips": net.addresses,
            "ns": {m: net.ns(m) for m in net.members},
        }
        (out / "plan.json").write_text(json.dumps(plan, indent=1))
        cmd = [
            *net.exec_prefix("client"),
            sys.executable,
            "-m",
            "bench.chaos.run",
            str(out / "plan.json"),
        ]
        with open(out / "orchestrator.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
            assert proc.stdout is not None
            timer = threading.Timer(cfg.max_seconds + INNER_TIMEOUT_SLACK_S, proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    if stream is not None:
                        stream.write(line.decode(errors="replace"))
                        stream.flush()
                inner_rc = proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        _kill_namespace_processes(net)
        net.down()
    h = history.load_files(sorted(str(p) for p in out.glob("*.jsonl")))
    report = checker.check(h, ELECTION_ALLOWANCE_S)
    if inner_rc != 0:
        report.violations.append(
            f"the orchestrator exited with {inner_rc}; see {out / 'orchestrator.log'}"
        )
    errors = [e for e in h.events if e.kind == "fault-error"]
    report.figures["fault_errors"] = len(errors)
    report.violations += [f"fault did not complete: {e.detail}" for e in errors]
    rejected = [e for e in h.events if e.kind == "unexpected-rejection"]
    report.figures["unexpected_rejections"] = len(rejected)
    report.violations += [f"live agent's write refused: {e.detail}" for e in rejected[:10]]
    from bench.chaos import report as chaos_report

    paths = chaos_report.write(out, cfg, report, started, time.monotonic() - t0)
    return Outcome(report, paths, inner_rc)


if __name__ == "__main__":
    sys.exit(inner_main(sys.argv[1:]))
