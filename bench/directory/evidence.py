"""`kvdir bench directory --shards 4 --evidence`: issue 31's evidence run.

Real processes on this host: `ShardedCluster` (4 groups x 3 `kvdir directory
serve` replicas, 2 shards per group, the map in g0's log) and a `ShardedMirror`
(one table per group, each fed by its group's Watch, following the map).

- publish: `--entries` (default 8,000,000) entries from `--clients` spawned
  publisher processes of 2 nodes each; every node's writes go through its own
  `ShardedDirectoryClient` in 1,024-entry batches (bench/directory/evidence_publish.py);
  each acknowledged batch number is recorded (the batch's hashes replay from it).
- while they publish, one after another, each when its share of the entries
  has been acknowledged: a SIGKILL of g0's leader (restarted, waited on until it
  caught up), `kvdir ctl shards split` of g0's first shard, `kvdir ctl shards
  move` of g3's second shard to g1, then the leaders of g1, g2 and g3 the same way.
- afterwards: every acknowledged entry looked up through the sharded client (RPC,
  complete: each acknowledged batch as one chain, a short answer resolved block by
  block); each group's replicas' table digests at one applied index; the
  mirror's digest of each group's table at that index. A mirror keeps one table
  per group, so "the mirror's table equals the union of the replicas' tables"
  is: for every group, its mirror table's digest equals that group's replicas'
  digest (the groups own disjoint key ranges, so the union is their sum).
"""

from __future__ import annotations

import datetime as dt
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from bench.directory import evidence_publish as ep
from bench.directory.config import Config
from bench.directory.shards import _leader, _rejoined
from bench.host import load_average, rss_bytes
from bench.measure import deadline_loop, say
from kvdir.core.client import DirectoryError
from kvdir.core.shard_map import ShardMap
from kvdir.core.sharded_client import GROUP_DOWN_S, ShardedDirectoryClient
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.local import ShardedCluster
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

GROUPS = 4
REPLICAS = 3
SHARDS_PER_GROUP = 2
NODES_PER_PUBLISHER = 2
LEASE_MS = 600_000
HEARTBEAT_S = 60.0
SPLIT_SHARD = 0
"""g0's first shard (even_map deals shards to the groups in turn)."""
MOVE_SHARD = 7
"""g3's second shard ..."""
MOVE_TO = "g1"
"""... moved to g1: every group still owns keys afterwards."""
EVENTS: tuple[tuple[float, str, str], ...] = (
    (0.03, "kill", "g0"),
    (0.08, "split", "g0"),
    (0.10, "move", "g3"),
    (0.25, "kill", "g1"),
    (0.35, "kill", "g2"),
    (0.45, "kill", "g3"),
)
"""(share of the entries acknowledged before it starts, what, group): run in order,
each after the one before it ended."""
START_S = 120.0
AFTER_KILL_S = 60.0
REJOIN_S = 300.0
SPLIT_S = 60.0
MOVE_S = 600.0
MAP_LEARNED_S = 60.0
SETTLE_S = 300.0
DIGEST_S = 600.0
DIGEST_ATTEMPTS = 5
VERIFY_LOOKUPS = 2
"""Chains per LookupBatch (8,192 blocks: about 2,048 per group, well inside the sharded
client's 1 s bound per group on a quiet host)."""
VERIFY_CHAIN_BATCHES = 4
"""One node's acknowledged 1,024-entry batches per chain (4,096 blocks: the limit)."""
VERIFY_THREADS = 2
VERIFY_RETRIES = 5


def plan(kills: int) -> list[tuple[float, str, str]]:
    """EVENTS with the first `kills` leader kills only (--kills; the smoke test runs one)."""
    first = [e for e in EVENTS if e[1] == "kill"][:kills]
    return [e for e in EVENTS if e[1] != "kill" or e in first]


class Run:
    def __init__(self, cfg: Config, base: str) -> None:
        self.cfg = cfg
        self.base = base
        self.cluster = ShardedCluster(
            os.path.join(base, "cluster"),
            groups=GROUPS,
            size=REPLICAS,
            shards_per_group=SHARDS_PER_GROUP,
        )
        self.incarnation = time.time_ns()
        self.seed = cfg.seed
        self.publishers = max(1, cfg.clients)
        self.nodes = self.publishers * NODES_PER_PUBLISHER
        self.results: dict[str, Any] = {}
        self.ctx = mp.get_context("spawn")  # no gRPC state crosses a fork
        self.shared = ep.Shared(
            acked=self.ctx.Array("q", self.publishers),
            last_ack=self.ctx.Array("d", self.publishers, lock=False),
            ready=self.ctx.Array("i", self.publishers),
            go=self.ctx.Event(),
            stop=self.ctx.Event(),
        )
        self.acked = self.shared.acked
        self.last_ack = self.shared.last_ack
        self.stop_ev = self.shared.stop
        self.procs: list[Any] = []
        self.ctl: subprocess.Popen[bytes] | None = None

    # ---------------------------------------------------------------- helpers

    def acked_entries(self) -> int:
        return int(sum(self.acked[:]))

    def publishing(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def ctl_run(self, args: list[str], timeout_s: float, log_name: str) -> tuple[float, str]:
        """`kvdir ctl shards ARGS` as an operator runs it; (seconds, its output)."""
        home = ",".join(self.cluster.home.grpc_addresses)
        cmd = [sys.executable, "-m", "kvdir.cli", "ctl", "shards", *args, "--addr", home]
        cmd += ["--timeout", str(timeout_s)]
        log_path = os.path.join(self.base, log_name)
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            self.ctl = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = self.ctl.wait(timeout_s + 30.0)
            except subprocess.TimeoutExpired:
                self.ctl.kill()
                self.ctl.wait(10.0)
                rc = -9
            self.ctl = None
        took = time.monotonic() - t0
        with open(log_path, encoding="utf-8", errors="replace") as f:
            out = f.read()
        if rc != 0:
            raise RuntimeError(f"kvdir ctl shards {' '.join(args)} exited {rc}: {out[-2000:]}")
        return took, out

    # ---------------------------------------------------------------- events

    def kill(self, gid: str) -> dict[str, Any]:
        c = self.cluster.clusters[gid]
        leader = _leader(self.cluster, gid)
        t_kill = time.monotonic()
        c.kill(leader, signal.SIGKILL)
        rec: dict[str, Any] = {"killed": leader.replica_id, "t_kill": t_kill}
        for _ in deadline_loop(AFTER_KILL_S, 0.01):
            if max(self.last_ack[:]) > t_kill or not self.publishing():
                break
        new = _leader(self.cluster, gid, AFTER_KILL_S)
        rec["new_leader"] = new.replica_id
        rec["new_leader_after_s"] = time.monotonic() - t_kill
        c.launch(leader)
        rec["rejoined_s"] = _rejoined(self.cluster, gid, leader, REJOIN_S)
        return rec

    def split(self) -> dict[str, Any]:
        before = self.map_now()
        took, out = self.ctl_run(["split", str(SPLIT_SHARD)], SPLIT_S, "ctl-split.log")
        after = self.map_now()
        t0 = time.monotonic()
        self.cluster.wait_map_version(after.version, MAP_LEARNED_S)
        return {
            "shard": SPLIT_SHARD,
            "map_version": [before.version, after.version],
            "ctl_s": took,
            "learned_everywhere_s": time.monotonic() - t0,
            "output": out.splitlines()[:1],
        }

    def move(self) -> dict[str, Any]:
        before = self.map_now()
        entries0 = self.acked_entries()
        took, out = self.ctl_run(["move", str(MOVE_SHARD), "--to", MOVE_TO], MOVE_S, "ctl-move.log")
        after = self.map_now()
        t0 = time.monotonic()
        self.cluster.wait_map_version(after.version, MAP_LEARNED_S)
        owner = next(s.group_id for s in after.shards if s.shard_id == MOVE_SHARD)
        if owner != MOVE_TO:
            raise RuntimeError(f"shard {MOVE_SHARD} is owned by {owner} after the move")
        return {
            "shard": MOVE_SHARD,
            "to": MOVE_TO,
            "map_version": [before.version, after.version],
            "ctl_s": took,
            "acked_entries_during": self.acked_entries() - entries0,
            "learned_everywhere_s": time.monotonic() - t0,
            "output": [x for x in out.splitlines() if not x.startswith("  shard")][:12],
        }

    def map_now(self) -> ShardMap:
        with ShardedDirectoryClient(self.cluster.home.grpc_addresses, timeout_s=10.0) as sc:
            return sc.refresh_map(0, force=True)

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for share, what, gid in plan(self.cfg.kills):
            want = int(share * self.cfg.entries)
            for _ in deadline_loop(SETTLE_S + self.cfg.entries / 1000, 0.05):
                if self.acked_entries() >= want or not self.publishing():
                    break
            rec: dict[str, Any] = {"what": what, "group": gid}
            rec["acked_entries_at_start"] = self.acked_entries()
            rec["publishing_at_start"] = self.publishing()
            t0 = time.monotonic()
            rec.update(
                self.kill(gid)
                if what == "kill"
                else self.split()
                if what == "split"
                else self.move()
            )
            rec["wall_s"] = time.monotonic() - t0
            rec["publishing_at_end"] = self.publishing()
            rec["loadavg"] = load_average()
            say(
                f"  {what} {gid}: {rec['wall_s']:.1f} s "
                f"(at {rec['acked_entries_at_start']:,} acked entries; publishing "
                f"{rec['publishing_at_start']} -> {rec['publishing_at_end']})"
            )
            out.append(rec)
        return out

    # ---------------------------------------------------------------- publish

    def start_publishers(self) -> float:
        deadline = time.time() + max(600.0, self.cfg.entries / 2000)
        for p in range(self.publishers):
            job = ep.Job(
                home=list(self.cluster.home.grpc_addresses),
                nodes=[p * NODES_PER_PUBLISHER + t for t in range(NODES_PER_PUBLISHER)],
                node_count=self.nodes,
                entries=self.cfg.entries,
                seed=self.seed,
                incarnation=self.incarnation,
                deadline_wall=deadline,
                out_path=os.path.join(self.base, f"publisher-{p}.npz"),
            )
            proc = self.ctx.Process(
                target=ep.main,
                args=(job, self.shared, p),
                name=f"ev-publisher-{p}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
        for _ in deadline_loop(ep.READY_S, 0.05):
            if sum(self.shared.ready[:]) >= self.nodes:
                break
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError("a publisher process ended before it was ready")
        else:
            raise RuntimeError(f"publishers not ready within {ep.READY_S:.0f}s")
        self.shared.go.set()
        return deadline

    def join_publishers(self, deadline_wall: float) -> None:
        for p in self.procs:
            p.join(max(1.0, deadline_wall - time.time() + 120.0))
        alive = [p.name for p in self.procs if p.is_alive()]
        if alive:
            raise RuntimeError(f"publishers still running past the deadline: {alive}")

    def records(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for p in range(self.publishers):
            with np.load(os.path.join(self.base, f"publisher-{p}.npz")) as z:
                for key in z.files:
                    name, what = key.rsplit(":", 1)
                    out.setdefault(name, {})[what] = z[key]
        if len(out) != self.nodes:
            raise RuntimeError(f"records of {len(out)} of {self.nodes} nodes")
        return out

    def stop_publishers(self) -> None:
        self.stop_ev.set()
        for p in self.procs:
            p.join(15.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if self.ctl is not None and self.ctl.poll() is None:
            self.ctl.kill()
            self.ctl.wait(10.0)

    # ---------------------------------------------------------------- checks

    def settle(self, mirror: ShardedMirror) -> dict[str, Any]:
        """Until every replica of each group applied the same index and the mirror's
        table of that group reached it (no writes are coming: the load ended)."""
        t0 = time.monotonic()
        last: dict[str, Any] = {}
        for _ in deadline_loop(SETTLE_S, 0.2):
            ok = True
            for gid, c in self.cluster.clusters.items():
                st = c.statuses()
                idx = {s.applied_index for s in st.values()} | {s.commit_index for s in st.values()}
                last[gid] = {
                    "replicas": {k: s.applied_index for k, s in st.items()},
                    "mirror": mirror.mirrors[gid].applied_index,
                }
                mine = mirror.mirrors[gid].applied_index
                if len(st) != REPLICAS or idx != {mine}:
                    ok = False
            if ok:
                return {"settled_s": time.monotonic() - t0, "applied": last}
        raise RuntimeError(f"replicas and mirror did not settle within {SETTLE_S:.0f}s: {last}")

    def compare(self, mirror: ShardedMirror) -> dict[str, Any]:
        """Settle, then the digests; again (bounded) if an index moved in between
        (a command committed after the settling: the digests are then of different
        states and say nothing). Digests that differ at one index are the failure."""
        for attempt in range(1, DIGEST_ATTEMPTS + 1):
            say("settling: every replica and the mirror at one index per group")
            self.results["settle"] = self.settle(mirror)
            say("digests: ClusterStatus(with_digest) of every replica, the mirror's own")
            out = self.digests(mirror)
            self.results["digest_attempts"] = attempt
            if all(g["one_index"] for g in out.values()):
                return out
            say("  an applied index moved while the digests were taken: again")
        return out

    @staticmethod
    def _digest(addr: str) -> dict[str, Any]:
        with grpc.insecure_channel(addr) as ch:
            st = pb_grpc.PrefixDirectoryStub(ch).ClusterStatus(
                pb.ClusterStatusRequest(with_digest=True), timeout=DIGEST_S
            )
        return {
            "applied_index": st.applied_index,
            "entries": st.entries,
            "digest": st.state_digest.hex(),
        }

    def digests(self, mirror: ShardedMirror) -> dict[str, Any]:
        """Each replica's ClusterStatus digest (a group's three asked at once) and
        the mirror's digest of that group's table."""
        out: dict[str, Any] = {}
        mine = mirror.digests()
        with ThreadPoolExecutor(REPLICAS) as pool:
            for gid, c in self.cluster.clusters.items():
                t0 = time.monotonic()
                futs = {r.replica_id: pool.submit(self._digest, r.grpc_address) for r in c.replicas}
                reps = {rid: f.result(DIGEST_S) for rid, f in futs.items()}
                idx, dg = mine[gid]
                digests = {v["digest"] for v in reps.values()}
                indexes = {v["applied_index"] for v in reps.values()}
                whole = len(reps) == REPLICAS
                out[gid] = {
                    "replicas": reps,
                    "mirror": {
                        "applied_index": idx,
                        "digest": dg.hex(),
                        "entries": mirror.mirrors[gid].table.entries,
                    },
                    "one_index": whole and indexes == {idx},
                    "replicas_agree": whole and len(digests) == 1 and len(indexes) == 1,
                    "mirror_equal": whole and digests == {dg.hex()} and indexes == {idx},
                    "wall_s": time.monotonic() - t0,
                }
                g = out[gid]
                say(
                    f"  {gid}: replicas agree {g['replicas_agree']}, mirror equal "
                    f"{g['mirror_equal']} (index {idx}, {g['mirror']['entries']:,} "
                    f"entries, {dg.hex()[:16]})"
                )
        return out

    def verify(self, sc: ShardedDirectoryClient, recs: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Every acknowledged batch looked up (RPC, through the sharded client), in a
        seeded random order within --verify-s: complete when it fits, else a uniform
        sample (the report says which)."""
        t0 = time.monotonic()
        end = t0 + self.cfg.verify_s
        # Up to VERIFY_CHAIN_BATCHES of one node's batches make one chain: that node
        # holds all of it, so its prefix must be the chain's length.
        units: list[tuple[str, list[int]]] = []
        for name, r in sorted(recs.items()):
            bs = r["acked"].tolist()
            for i in range(0, len(bs), VERIFY_CHAIN_BATCHES):
                units.append((name, [int(b) for b in bs[i : i + VERIFY_CHAIN_BATCHES]]))
        order = np.random.default_rng(self.seed).permutation(len(units)).tolist()
        parts = [
            [units[j] for j in order[i : i + VERIFY_LOOKUPS]]
            for i in range(0, len(order), VERIFY_LOOKUPS)
        ]
        totals = {"lost": 0, "short": 0, "looked": 0, "parts": 0}
        lock = threading.Lock()

        def check(part: list[tuple[str, list[int]]]) -> None:
            if time.monotonic() >= end:
                return
            chains = [
                [
                    h
                    for b in bs
                    for h in ep.batch_hashes(self.seed, b, ep.batch_size(self.cfg.entries, b))
                ]
                for _, bs in part
            ]
            lost = short = looked = 0
            for (name, _bs), ch, got in zip(part, chains, self._lookup(sc, chains), strict=True):
                looked += len(ch)
                if got.get(name, 0) != len(ch):
                    short += 1
                    lost += self._missing(sc, ch, name)
            with lock:
                totals["lost"] += lost
                totals["short"] += short
                totals["looked"] += looked
                totals["parts"] += 1

        with ThreadPoolExecutor(VERIFY_THREADS) as pool:
            for f in [pool.submit(check, part) for part in parts]:
                f.result(self.cfg.verify_s + 120.0)
        acked = sum(ep.batch_size(self.cfg.entries, b) for _, bs in units for b in bs)
        complete = totals["parts"] == len(parts)
        return {
            "method": f"each acknowledged batch, {VERIFY_CHAIN_BATCHES} of one node's to a "
            "chain, in ShardedDirectoryClient.lookup_batch (split by group, merged), "
            f"{VERIFY_THREADS} threads, a short prefix resolved block by block; "
            + (
                "complete, not sampled"
                if complete
                else f"SAMPLED: a uniform random {totals['looked'] / max(1, acked):.1%} "
                f"(the --verify-s {self.cfg.verify_s:.0f} s bound)"
            ),
            "complete": complete,
            "acked_entries": acked,
            "entries_looked_up": totals["looked"],
            "chains_short_first_pass": totals["short"],
            "lost_entries": totals["lost"],
            "wall_s": time.monotonic() - t0,
        }

    def _lookup(
        self, sc: ShardedDirectoryClient, chains: list[list[bytes]]
    ) -> list[dict[str, int]]:
        reqs = [
            pb.LookupRequest(
                namespace=ep.NAMESPACE,
                packed_hashes=b"".join(c),
                hash_width=8,
                omit_records=True,
                max_nodes=4,
            )
            for c in chains
        ]
        last: Exception | None = None
        for _ in range(VERIFY_RETRIES):
            try:
                resp = sc.lookup_batch(reqs, _chains=chains)
                return [{m.node_id: m.prefix_blocks for m in r.matches} for r in resp.results]
            except DirectoryError as e:
                last = e
                time.sleep(0.2)  # a back-off between retries
        raise RuntimeError(f"verification lookup failed: {last}")

    def _missing(self, sc: ShardedDirectoryClient, chain: list[bytes], name: str) -> int:
        """Blocks of `chain` that `name` does not hold. The sharded client counts a
        group that did not answer within its lookup bound (1 s) as holding nothing
        and skips it for GROUP_DOWN_S: a short answer on a loaded host is asked
        again after that interval, the whole chain first, then block by block."""
        for _ in range(VERIFY_RETRIES):
            time.sleep(GROUP_DOWN_S + 0.1)  # past the client's skip interval
            if self._lookup(sc, [chain])[0].get(name, 0) == len(chain):
                return 0
        out = 0
        for i in range(0, len(chain), 256):
            blocks = [[h] for h in chain[i : i + 256]]
            got = [r.get(name, 0) for r in self._lookup(sc, blocks)]
            for _ in range(VERIFY_RETRIES):
                if all(got):
                    break
                time.sleep(GROUP_DOWN_S + 0.1)  # past the client's skip interval
                got = [r.get(name, 0) for r in self._lookup(sc, blocks)]
            out += sum(1 for g in got if not g)
        return out

    # ---------------------------------------------------------------- the run

    def measure(self) -> None:
        say(f"starting {GROUPS} groups x {REPLICAS} replicas under {self.base}")
        self.cluster.start(timeout_s=START_S)
        sc = ShardedDirectoryClient(self.cluster.home.grpc_addresses, timeout_s=10.0)
        hb_stop = threading.Event()
        try:
            names = [ep.node_id(k) for k in range(self.nodes)]
            for n in names:
                sc.register_node(
                    n, "127.0.0.1", self.incarnation, "127.0.0.1:9000", ["tcp"], LEASE_MS
                )

            def beat() -> None:
                while not hb_stop.wait(HEARTBEAT_S):
                    for n in names:
                        try:
                            sc.heartbeat(n, self.incarnation)
                        except DirectoryError as e:
                            say(f"heartbeat of {n} failed: {e}")

            threading.Thread(target=beat, name="ev-heartbeats", daemon=True).start()
            mirror = ShardedMirror(sc.shard_map, max_staleness_s=5.0)
            with ShardedMirrorSync(mirror, follow=sc.refresh_map):
                self.load_publish(sc, mirror)
                hb_stop.set()
                self.results["digests"] = self.compare(mirror)
            say("verification: every acknowledged entry through the sharded client")
            self.results["verification"] = self.verify(sc, self.records())
            v = self.results["verification"]
            say(f"  {v['entries_looked_up']:,} entries looked up, {v['lost_entries']} lost")
        finally:
            hb_stop.set()
            sc.close()

    def load_publish(self, sc: ShardedDirectoryClient, mirror: ShardedMirror) -> None:
        cfg = self.cfg
        say(
            f"publishing {cfg.entries:,} entries: {self.publishers} processes x "
            f"{NODES_PER_PUBLISHER} nodes, {ep.BATCH}-entry batches through the sharded client"
        )
        deadline = self.start_publishers()
        load0 = load_average()
        t0 = time.monotonic()
        progress = threading.Event()

        def report_progress() -> None:
            while not progress.wait(10.0):
                say(f"  {self.acked_entries():,} acknowledged entries, load {load_average()}")

        threading.Thread(target=report_progress, daemon=True).start()
        try:
            self.results["events"] = self.events()
            self.join_publishers(deadline)
        finally:
            progress.set()
        t1 = time.monotonic()
        recs = self.records()
        times = np.sort(np.concatenate([r["times"] for r in recs.values()]))
        acked = sum(
            sum(ep.batch_size(cfg.entries, int(b)) for b in r["acked"].tolist())
            for r in recs.values()
        )
        unacked = sum(len(r["unacked"]) for r in recs.values())
        last = float(times[-1]) if len(times) else t1
        for ev in self.results["events"]:
            if ev["what"] == "kill":
                tk = ev.pop("t_kill")
                before = times[times <= tk]
                after = times[times > tk]
                ev["gap_s"] = (
                    float(after[0] - before[-1]) if len(before) and len(after) else math.nan
                )
        self.results["publish"] = {
            "entries": cfg.entries,
            "acked_entries": acked,
            "batches_unacked": unacked,
            "publish_failures_resent": int(sum(int(r["failures"][0]) for r in recs.values())),
            "window_s": last - t0,
            "entries_per_s": acked / (last - t0) if last > t0 else math.nan,
            "loadavg": [load0, load_average()],
            "rss_bytes": {
                f"{g}/{r.replica_id}": rss_bytes(r.proc.pid)
                for g, c in self.cluster.clusters.items()
                for r in c.replicas
                if r.proc is not None and r.alive
            },
            "mirror_process_rss_bytes": rss_bytes(os.getpid()),
        }
        p = self.results["publish"]
        say(
            f"  {acked:,} acknowledged entries in {p['window_s']:.1f} s: "
            f"{fmt(p['entries_per_s'])} entries/s"
        )


def summary(r: dict[str, Any]) -> dict[str, Any]:
    ev = r.get("events", [])
    dg = r.get("digests", {})
    v = r.get("verification", {})
    return {
        "entries_per_s": r.get("publish", {}).get("entries_per_s"),
        "kill_gap_s": {e["group"]: e.get("gap_s") for e in ev if e["what"] == "kill"},
        "split_s": next((e["ctl_s"] for e in ev if e["what"] == "split"), None),
        "move_s": next((e["ctl_s"] for e in ev if e["what"] == "move"), None),
        "events_during_publish": all(e["publishing_at_start"] for e in ev) if ev else None,
        "lost_entries": v.get("lost_entries"),
        "verification_complete": v.get("complete"),
        "replicas_agree": all(g["replicas_agree"] for g in dg.values()) if dg else None,
        "mirror_equals_replicas": all(g["mirror_equal"] for g in dg.values()) if dg else None,
    }


def markdown(data: dict[str, Any]) -> str:
    from kvdir import report

    r, s = data["results"], data.get("summary", {})
    lines = [
        "# kvdir bench directory --shards 4 --evidence (issue 31)",
        "",
        report.header_markdown(data["header"]),
        "",
    ]
    if "error" in data:
        lines += ["**The run failed:**", "", "```", data["error"][-3000:], "```", ""]
    load = data["header"].get("loadavg_start") or [0.0]
    if load and load[0] > 1.0:
        lines += [
            f"**Loaded host (load average {load[0]:.2f} at start): not a quiet-host result.**",
            "",
        ]
    p = r.get("publish", {})
    lines += [
        "| what | value |",
        "|---|---|",
        f"| entries acknowledged / asked | {p.get('acked_entries', 0):,} / "
        f"{data['config']['entries']:,} |",
        "| publish entries/s (first publish to last ack, events included) | "
        f"{fmt(s.get('entries_per_s'))} |",
        f"| batches never acknowledged (resent until the deadline) | {p.get('batches_unacked')} |",
        f"| publishes failed and resent | {p.get('publish_failures_resent')} |",
        f"| every event started while publishing | {fmt(s.get('events_during_publish'))} |",
        f"| acknowledged entries lost | {fmt(s.get('lost_entries'))} |",
        f"| each group's replicas agree (digest, index) | {fmt(s.get('replicas_agree'))} |",
        f"| mirror's per-group digest = replicas' | {fmt(s.get('mirror_equals_replicas'))} |",
        "",
        "## Events (in order, during the publishing)",
        "",
        "| what | group | at acked entries | wall s | write gap ms | new leader after s | "
        "rejoined s | ctl s | map learned by all s | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in r.get("events", []):
        gap = e.get("gap_s")
        shown = "" if gap is None else "no writes after" if math.isnan(gap) else f"{gap * 1e3:.0f}"
        lines.append(
            f"| {e['what']} | {e['group']} | {e['acked_entries_at_start']:,} | {e['wall_s']:.1f} | "
            f"{shown} | "
            f"{fmt(e.get('new_leader_after_s', ''))} | "
            f"{fmt(e.get('rejoined_s', ''))} | {fmt(e.get('ctl_s', ''))} | "
            f"{fmt(e.get('learned_everywhere_s', ''))} | {e['loadavg'][0]:.1f} |"
        )
    lines += [
        "",
        "## Digests (after the load; every replica and the mirror at one index)",
        "",
        "| group | applied index | entries | replicas' digest | mirror's digest | equal |",
        "|---|---|---|---|---|---|",
    ]
    for gid, g in r.get("digests", {}).items():
        reps = g["replicas"]
        one: dict[str, Any] = next(iter(reps.values()), {})
        rd = ", ".join(sorted({v["digest"][:16] for v in reps.values()}))
        lines.append(
            f"| {gid} | {one.get('applied_index')} | {one.get('entries', 0):,} | {rd} | "
            f"{g['mirror']['digest'][:16]} | {fmt(g['replicas_agree'] and g['mirror_equal'])} |"
        )
    v = r.get("verification", {})
    lines += [
        "",
        f"Verification: {v.get('method', '-')}; {v.get('entries_looked_up', 0):,} entries looked "
        f"up in {v.get('wall_s', 0):.0f} s, {v.get('chains_short_first_pass')} chains short "
        "at first "
        "(a group past the sharded client's 1 s lookup bound counts as holding nothing: "
        "asked again), "
        f"{v.get('lost_entries')} entries lost.",
        "",
        "The mirror keeps one table per group (docs/sharding.md); the groups own disjoint "
        "key ranges, so its tables together equal the union of the replicas' tables when each "
        "group's table digest equals that group's replicas' digest at the same applied index, "
        "which the Digests table shows. Write gap: the last acknowledged publish before the "
        "SIGKILL to the first after it, over every publisher (every 1,024-entry batch has "
        "blocks in every group). Rejoined: the restarted replica follows a leader and applied "
        "the leader's commit index. Split and move: `kvdir ctl shards split|move` as a "
        "subprocess, its wall time.",
        "",
    ]
    return "\n".join(lines)


def run(cfg: Config) -> int:
    from kvdir import report

    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    data: dict[str, Any] = {
        "header": report.header(started),
        "config": {
            "entries": cfg.entries,
            "groups": GROUPS,
            "replicas": REPLICAS,
            "shards_per_group": SHARDS_PER_GROUP,
            "publishers": max(1, cfg.clients),
            "nodes_per_publisher": NODES_PER_PUBLISHER,
            "batch": ep.BATCH,
            "seed": cfg.seed,
            "events": [list(e) for e in plan(cfg.kills)],
            "split_shard": SPLIT_SHARD,
            "move_shard": MOVE_SHARD,
            "move_to": MOVE_TO,
        },
    }
    tmp = None if cfg.data_dir else tempfile.mkdtemp(prefix="kvdir-bench-evidence-")
    base = cfg.data_dir or tmp
    assert base is not None
    os.makedirs(base, exist_ok=True)
    say(f"replica data and logs under {base}")
    r = Run(cfg, base)
    data["results"] = r.results
    try:
        r.measure()
    except Exception as e:
        data["error"] = traceback.format_exc()
        say(f"benchmark failed: {e!r}; replica logs kept under {base}")
    finally:
        r.stop_publishers()
        r.cluster.stop()
    data["header"]["wall_s"] = time.monotonic() - t0
    data["header"]["source_fingerprint_end"] = report.source_fingerprint()
    data["summary"] = summary(r.results)
    s = data["summary"]
    ok = (
        s["lost_entries"] == 0
        and s["replicas_agree"] is True
        and s["mirror_equals_replicas"] is True
        and r.results.get("publish", {}).get("batches_unacked", 1) == 0
        and r.results.get("publish", {}).get("acked_entries") == cfg.entries
    )
    if not ok and "error" not in data:
        data["error"] = f"a check failed: {s}"
    md = markdown(data)
    md_path, js_path = report.write(
        cfg.out_dir, f"directory-shards-evidence-{started:%Y-%m-%d}", md, data
    )
    print(md)
    say(f"wrote {md_path} and {js_path}")
    if tmp is not None and "error" not in data:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if "error" in data else 0
