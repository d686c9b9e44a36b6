"""`kvdir bench directory --shards 1 2 4`: the sharded directory at several sizes, one run.

For each size N a fresh `ShardedCluster` (N groups x 3 real replica processes,
group g0 holding the map), measured the same way:

- publish: every entry published once, the batches split by group on the
  client side (as the sharded client splits an agent's batch) and sent
  straight to each group's leader, `--publish-inflight` per group from the
  worker processes; committed entries/s over the window; CPU seconds per
  1,000 entries summed over every replica process (/proc/PID/stat, from
  before the load until every replica applied it); bytes per entry (the
  replicas' RSS growth over the entries they hold).
- mirror: a `ShardedMirror` fed by every group's Watch; lookup p50 of a
  500-block chain (the full `LookupResponse`, in process).
- rpc: `ShardedDirectoryClient.lookup` of 500-block chains from one thread
  (split, fanned out, merged): p50 / p99.
- kills: a writer publishing 64-entry chains through the sharded client;
  `--kills` leader SIGKILLs round robin over the groups; the write gap of
  each; every acknowledged entry looked up afterwards (lost = acknowledged
  and absent).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.directory.config import Config
from bench.host import load_average, proc_cpu_s, rss_bytes
from bench.measure import deadline_loop, ms_stats_from_ns, say, us_stats_from_ns
from bench.workers import CallTask, WorkerPool
from kvdir.core.client import DirectoryClient, DirectoryError
from kvdir.core.shard_map import ShardMap
from kvdir.core.sharded_client import ShardedDirectoryClient
from kvdir.core.sharded_mirror import ShardedMirror, ShardedMirrorSync
from kvdir.local import Replica, ShardedCluster
from kvdir.report import fmt
from kvdir.v1 import directory_pb2 as pb

NAMESPACE = pb.Namespace(
    model="meta-llama/Llama-3.1-8B", dtype="bf16", block_tokens=16, layout="vllm-paged"
)
CHAIN_BLOCKS = 500
NODES = 16
LEASE_MS = 600_000
HEARTBEAT_S = 60.0
WRITER = "bench-writer"
WRITER_BATCH = 64
IDLE_SAMPLE_S = 3.0
VERIFY_BATCH = 64
"""Acknowledged writer chains looked up per LookupBatch when counting losses."""
KILL_STEADY_S = 1.0
"""Steady writing before each kill (not a wait for a condition: the baseline)."""
AFTER_KILL_S = 30.0
CATCH_UP_S = 300.0
MIRROR_SYNC_S = 300.0
PUBLISH = "/kvdir.v1.PrefixDirectory/Publish"


def h(i: int) -> bytes:
    """Block hash number i: 8 bytes of blake2b (uniform, as engines' hashes)."""
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=8).digest()


def chain(c: int) -> list[bytes]:
    return [h(c * CHAIN_BLOCKS + i) for i in range(CHAIN_BLOCKS)]


def node(c: int) -> str:
    return f"bench-node-{c % NODES:02d}"


@dataclass
class Size:
    """One cluster size's state and results."""

    groups: int
    cluster: ShardedCluster
    chains: int
    incarnation: int = field(default_factory=time.time_ns)
    results: dict[str, Any] = field(default_factory=dict)
    acked: list[int] = field(default_factory=list)

    @property
    def map(self) -> ShardMap:
        return self.cluster.initial_map

    @property
    def entries(self) -> int:
        return self.chains * CHAIN_BLOCKS


# ------------------------------------------------------------------ cluster


def _replicas(sc: ShardedCluster) -> list[tuple[str, Replica]]:
    return [(g, r) for g, c in sc.clusters.items() for r in c.replicas]


def _replica_cpu(sc: ShardedCluster) -> dict[str, float]:
    return {
        f"{g}/{r.replica_id}": proc_cpu_s(r.proc.pid)
        for g, r in _replicas(sc)
        if r.proc is not None and r.alive
    }


def _replica_rss(sc: ShardedCluster) -> dict[str, int]:
    return {
        f"{g}/{r.replica_id}": rss_bytes(r.proc.pid)
        for g, r in _replicas(sc)
        if r.proc is not None and r.alive
    }


def _status(address: str) -> pb.ClusterStatusResponse | None:
    with DirectoryClient([address], timeout_s=1.0) as c:
        try:
            return c.status(address)
        except DirectoryError:
            return None


def _leader(sc: ShardedCluster, gid: str, timeout_s: float = 30.0) -> Replica:
    cl = sc.clusters[gid]
    for _ in deadline_loop(timeout_s, 0.05):
        found = cl.leader()
        if found is not None:
            return found
    raise RuntimeError(f"group {gid}: no agreed leader within {timeout_s:.0f}s")


RESEND_TIMEOUT_S = 30.0


def _resend(sc: ShardedCluster, reqs: dict[str, list[bytes]]) -> None:
    for g, rs in reqs.items():
        with DirectoryClient(sc.clusters[g].grpc_addresses, timeout_s=RESEND_TIMEOUT_S) as c:
            for r in rs:
                c.call("Publish", pb.PublishRequest.FromString(r))


def _wait_entries(sc: ShardedCluster, want: dict[str, int], timeout_s: float) -> float:
    """Wait until every live replica of every group holds its group's entries."""
    t0 = time.monotonic()
    for _ in deadline_loop(timeout_s, 0.1):
        ok = True
        for g, r in _replicas(sc):
            if not r.alive:
                continue
            s = _status(r.grpc_address)
            if s is None or s.entries < want[g]:
                ok = False
                break
        if ok:
            return time.monotonic() - t0
    raise RuntimeError(f"replicas did not apply the load within {timeout_s:.0f}s")


def _heartbeats(sc: ShardedDirectoryClient, nodes: Sequence[str], inc: int) -> threading.Event:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(HEARTBEAT_S):
            for n in nodes:
                try:
                    sc.heartbeat(n, inc)
                except DirectoryError as e:
                    say(f"heartbeat of {n} failed: {e}")

    threading.Thread(target=loop, name="bench-heartbeats", daemon=True).start()
    return stop


# ------------------------------------------------------------------ publish


def _requests(s: Size, batch: int) -> dict[str, list[bytes]]:
    """Serialized Publish requests per group: each chain's blocks split by owner and
    gathered per (group, node) into `batch`-entry requests, so every group count
    sends requests of the same size (as an agent's 4,096-entry batch splits into
    parts of about 4,096 / N)."""
    out: dict[str, list[bytes]] = {g.group_id: [] for g in s.map.groups}
    pending: dict[tuple[str, int], list[tuple[bytes, int, int]]] = {}

    def flush(g: str, n: int) -> None:
        items = pending.pop((g, n), [])
        if items:
            out[g].append(
                pb.PublishRequest(
                    node_id=f"bench-node-{n:02d}",
                    incarnation=s.incarnation,
                    namespace=NAMESPACE,
                    tier=pb.TIER_GPU,
                    block_hashes=[x[0] for x in items],
                    addresses=[x[1] * 65536 for x in items],
                    lengths=[65536] * len(items),
                    rkeys=[x[2] % 997 + 1 for x in items],
                    generations=[1] * len(items),
                ).SerializeToString()
            )

    for c in range(s.chains):
        hs = chain(c)
        base, n = c * CHAIN_BLOCKS, c % NODES
        for g, pos in s.map.positions_by_group(hs).items():
            part = pending.setdefault((g, n), [])
            part.extend((hs[j], base + j, c) for j in pos)
            if len(part) >= batch:
                flush(g, n)
    for g, n in list(pending):
        flush(g, n)
    return out


def _idle_cpu(sc: ShardedCluster) -> float:
    """Replica CPU seconds per second with no load (Raft ticks, lease sweeps, Watch
    heartbeats): what N groups cost doing nothing, reported apart from the load's."""
    c0, t0 = _replica_cpu(sc), time.monotonic()
    time.sleep(IDLE_SAMPLE_S)  # a measuring interval, not a wait for a condition
    c1 = _replica_cpu(sc)
    return sum(c1[k] - c0[k] for k in c0 if k in c1) / (time.monotonic() - t0)


def publish(s: Size, cfg: Config, pool: WorkerPool) -> None:
    reqs = _requests(s, cfg.publish_batch)
    per_group = max(1, pool.size // s.groups)
    threads = max(1, math.ceil(cfg.publish_inflight / per_group))
    start_at = time.time() + 1.0
    tasks = []
    for g, rs in reqs.items():
        leader = _leader(s.cluster, g)
        for w in range(per_group):
            tasks.append(
                CallTask(
                    leader.grpc_address,
                    PUBLISH,
                    "PublishResponse",
                    rs[w::per_group],
                    start_at,
                    0.0,
                    len(rs),
                    threads=threads,
                    timeout_s=30.0,
                    sum_field="applied",
                )
            )
    want = {
        g: sum(len(pb.PublishRequest.FromString(r).block_hashes) for r in rs)
        for g, rs in reqs.items()
    }
    say(
        f"{s.groups} group(s): loading {s.entries:,} entries as {sum(map(len, reqs.values()))} "
        f"Publish RPCs ({per_group} process(es) x {threads} threads per group leader)"
    )
    idle_cpu_per_s = _idle_cpu(s.cluster)
    rss0, cpu0, load0 = _replica_rss(s.cluster), _replica_cpu(s.cluster), load_average()
    t0 = time.monotonic()
    res = pool.run(tasks, timeout_s=max(600.0, s.entries / 2000))
    window = max(r.finished for r in res) - min(r.started for r in res)
    failed = sum(r.failed for r in res)
    if failed:
        # The workers send to the leader they were given; a leader that changed
        # mid-load (an election on a saturated host) refuses the rest. The entries
        # still have to be in for the later phases: sent again, whole, through
        # clients that follow the leader (a Publish applied twice holds the same).
        say(f"  {failed} Publish RPCs refused (a leader changed?); sending the load again")
        _resend(s.cluster, reqs)
    caught = _wait_entries(s.cluster, want, CATCH_UP_S)
    cpu1, rss1 = _replica_cpu(s.cluster), _replica_rss(s.cluster)
    span = time.monotonic() - t0
    applied = sum(r.summed for r in res)
    cpu_s = sum(cpu1[k] - cpu0[k] for k in cpu0)
    idle_s = idle_cpu_per_s * span
    grown = sum(rss1[k] - rss0.get(k, 0) for k in rss1)
    copies = s.entries * s.cluster.size  # every entry is held by its group's replicas
    s.results["publish"] = {
        "entries": s.entries,
        "entries_applied": applied,
        "rpcs_failed": failed,
        "valid": failed == 0,
        "wall_s": window,
        "entries_per_s": applied / window if window > 0 else math.nan,
        "entries_per_group": want,
        "rpc_latency": ms_stats_from_ns([x for r in res for x in r.latencies_ns]),
        "replica_cpu_s": cpu_s,
        "cpu_s_per_1000_entries": 1000 * cpu_s / max(1, applied),
        "idle_cpu_s_per_s": idle_cpu_per_s,
        "cpu_s_per_1000_entries_less_idle": 1000 * max(0.0, cpu_s - idle_s) / max(1, applied),
        "cpu_span_s": span,
        "replicas_caught_up_after_s": caught,
        "bytes_per_entry": grown / copies,
        "rss_bytes_loaded": rss1,
        "loadavg": [load0, load_average()],
    }
    say(
        f"  {fmt(applied / window)} entries/s, "
        f"{1000 * cpu_s / max(1, applied):.3f} CPU s / 1,000 entries "
        f"({1000 * max(0.0, cpu_s - idle_s) / max(1, applied):.3f} less idle), "
        f"{grown / copies:.0f} B/entry"
    )
    if applied != s.entries and not failed:  # else _wait_entries saw the resend land
        raise RuntimeError(f"{applied} entries applied of {s.entries}")


# ------------------------------------------------------------------ lookups


def _queries(s: Size, n: int = 64) -> list[list[bytes]]:
    step = max(1, s.chains // n)
    return [chain(c) for c in range(0, s.chains, step)][:n]


def _mirrored(m: ShardedMirror) -> int:
    return sum(x.table.entries for x in m.mirrors.values())


def mirror(s: Size, cfg: Config, sc: ShardedDirectoryClient) -> None:
    m = ShardedMirror(sc.shard_map, max_staleness_s=5.0)
    sync = ShardedMirrorSync(m).start()
    try:
        t0 = time.monotonic()
        for _ in deadline_loop(MIRROR_SYNC_S, 0.1):
            if m.fresh() and _mirrored(m) >= s.entries:
                break
        else:
            raise RuntimeError(f"the mirror held {_mirrored(m)} of {s.entries} entries")
        synced = time.monotonic() - t0
        qs = _queries(s)
        reqs = [
            pb.LookupRequest(namespace=NAMESPACE, packed_hashes=b"".join(q), hash_width=8)
            for q in qs
        ]
        for r in reqs:
            got = m.lookup_message(r).matches
            if not got or got[0].prefix_blocks != CHAIN_BLOCKS:
                raise RuntimeError("the mirror does not hold a whole chain")
        lat: list[int] = []
        end = time.perf_counter() + cfg.duration_s
        i = 0
        while time.perf_counter() < end:
            a = time.perf_counter_ns()
            m.lookup_message(reqs[i % len(reqs)])
            lat.append(time.perf_counter_ns() - a)
            i += 1
        s.results["mirror"] = {
            "synced_s": synced,
            "snapshots": m.snapshots,
            "lookup_500": us_stats_from_ns(lat),
            "group_lag_ms": {x.group_id: x.lag.ms for x in m.group_lags()},
        }
        say(f"  mirror lookup p50 {statistics.median(lat) / 1000:.1f} us ({len(lat)} lookups)")
    finally:
        sync.stop()


def rpc(s: Size, cfg: Config, sc: ShardedDirectoryClient) -> None:
    qs = _queries(s)
    reqs = [
        pb.LookupRequest(namespace=NAMESPACE, packed_hashes=b"".join(q), hash_width=8) for q in qs
    ]
    for q, r in zip(qs, reqs, strict=True):
        got = sc.lookup_message(r, q).matches
        if not got or got[0].prefix_blocks != CHAIN_BLOCKS:
            raise RuntimeError("an RPC lookup did not find a whole chain")
    lat: list[int] = []
    end = time.perf_counter() + cfg.duration_s
    i = 0
    while time.perf_counter() < end:
        a = time.perf_counter_ns()
        sc.lookup_message(reqs[i % len(reqs)], qs[i % len(qs)])
        lat.append(time.perf_counter_ns() - a)
        i += 1
    s.results["rpc"] = {"lookup_500": ms_stats_from_ns(lat), "lookups": len(lat)}
    say(f"  RPC lookup p50 {statistics.median(lat) / 1e6:.2f} ms ({len(lat)} lookups)")


# ------------------------------------------------------------------ kills


class Writer(threading.Thread):
    """Publishes 64-entry chains through the sharded client; records each ack."""

    def __init__(self, sc: ShardedDirectoryClient, inc: int) -> None:
        super().__init__(name="bench-shard-writer", daemon=True)
        self.sc, self.inc = sc, inc
        self.stop_ev = threading.Event()
        self.acks: list[tuple[int, float]] = []
        self.failed = 0
        self.seq = 0

    @staticmethod
    def hashes(seq: int) -> list[bytes]:
        return [h((1 << 48) + seq * WRITER_BATCH + i) for i in range(WRITER_BATCH)]

    def run(self) -> None:
        n = WRITER_BATCH
        while not self.stop_ev.is_set():
            seq, self.seq = self.seq, self.seq + 1
            try:
                self.sc.publish(
                    WRITER,
                    self.inc,
                    NAMESPACE,
                    pb.TIER_GPU,
                    self.hashes(seq),
                    [seq] * n,
                    [1] * n,
                    [1] * n,
                    [seq + 1] * n,
                )
                self.acks.append((seq, time.monotonic()))
            except DirectoryError:
                self.failed += 1


def kills(s: Size, cfg: Config, sc: ShardedDirectoryClient) -> None:
    w = Writer(sc, s.incarnation)
    w.start()
    recs: list[dict[str, Any]] = []
    try:
        for k in range(cfg.kills):
            g = s.map.groups[k % s.groups].group_id
            recs.append(_kill(s, w, g))
            gap_ms = recs[-1].get("gap_s", math.nan) * 1e3
            say(f"  kill {k + 1}/{cfg.kills} (group {g}): gap {gap_ms:.0f} ms")
    finally:
        w.stop_ev.set()
        w.join(timeout=60)
    acked = [seq for seq, _ in w.acks]
    lost = 0
    for i in range(0, len(acked), VERIFY_BATCH):
        reqs = [
            pb.LookupRequest(
                namespace=NAMESPACE, packed_hashes=b"".join(Writer.hashes(seq)), hash_width=8
            )
            for seq in acked[i : i + VERIFY_BATCH]
        ]
        for r in sc.lookup_batch(reqs).results:
            got = {m.node_id: m.prefix_blocks for m in r.matches}
            lost += WRITER_BATCH - got.get(WRITER, 0)
    gaps = [r["gap_s"] for r in recs if "gap_s" in r]
    s.results["kills"] = {
        "kills": recs,
        "gap_s": gaps,
        "gap_s_max": max(gaps) if gaps else math.nan,
        "gap_s_median": statistics.median(gaps) if gaps else math.nan,
        "writer_batches_acked": len(acked),
        "writer_failures": w.failed,
        "acked_entries": len(acked) * WRITER_BATCH,
        "acked_entries_lost": lost,
    }
    say(f"  {len(acked) * WRITER_BATCH:,} acknowledged writer entries, {lost} lost")


def _kill(s: Size, w: Writer, gid: str) -> dict[str, Any]:
    leader = _leader(s.cluster, gid)
    time.sleep(KILL_STEADY_S)  # steady writing before the kill (a baseline, not a wait)
    t_kill = time.monotonic()
    s.cluster.clusters[gid].kill(leader, signal.SIGKILL)
    rec: dict[str, Any] = {"group": gid, "killed": leader.replica_id}
    for _ in deadline_loop(AFTER_KILL_S, 0.01):
        if w.acks and w.acks[-1][1] > t_kill + 0.05:
            break
    before = [t for _, t in w.acks if t <= t_kill + 0.05]
    after = [t for _, t in w.acks if t > t_kill + 0.05]
    if before and after:
        rec["gap_s"] = after[0] - before[-1]
    else:
        rec["error"] = "no acknowledged write after the kill"
    s.cluster.clusters[gid].launch(leader)
    rec["rejoined_s"] = _rejoined(s.cluster, gid, leader, 120.0)
    return rec


def _rejoined(sc: ShardedCluster, gid: str, r: Replica, timeout_s: float) -> float:
    """Wait until restarted `r` follows a leader and applied what it had committed
    (the next kill then starts from a whole group, as the unsharded bench's)."""
    t0 = time.monotonic()
    for _ in deadline_loop(timeout_s, 0.05):
        leader = sc.clusters[gid].leader()
        if leader is r:
            return time.monotonic() - t0  # it leads again: caught up by definition
        if leader is None:
            continue
        ls, rs = _status(leader.grpc_address), _status(r.grpc_address)
        if (
            ls is not None
            and rs is not None
            and rs.leader_id
            and rs.applied_index >= ls.commit_index
        ):
            return time.monotonic() - t0
    raise RuntimeError(f"group {gid}: {r.replica_id} did not rejoin within {timeout_s:.0f}s")


# ------------------------------------------------------------------ the run


def measure(groups: int, cfg: Config, base: str, pool: WorkerPool) -> dict[str, Any]:
    chains = max(1, cfg.entries // CHAIN_BLOCKS)
    sc_dir = os.path.join(base, f"shards-{groups}")
    cluster = ShardedCluster(sc_dir, groups=groups, size=3)
    s = Size(groups, cluster, chains)
    t0 = time.monotonic()
    try:
        cluster.start(timeout_s=120)
        with ShardedDirectoryClient(cluster.home.grpc_addresses, timeout_s=10.0) as sc:
            nodes = [*sorted({node(c) for c in range(NODES)}), WRITER]
            for n in nodes:
                sc.register_node(n, "127.0.0.1", s.incarnation, "127.0.0.1:9000", ["tcp"], LEASE_MS)
            hb = _heartbeats(sc, nodes, s.incarnation)
            try:
                publish(s, cfg, pool)
                mirror(s, cfg, sc)
                rpc(s, cfg, sc)
                kills(s, cfg, sc)
            finally:
                hb.set()
    finally:
        cluster.stop()
    s.results["groups"] = groups
    s.results["replicas"] = groups * cluster.size
    s.results["wall_s"] = time.monotonic() - t0
    return s.results


def run_sizes(cfg: Config, base: str) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    clients = max(cfg.clients, *cfg.shards)
    with WorkerPool(clients) as pool:
        for n in cfg.shards:
            say(f"--- {n} group(s) x 3 replicas")
            out["sizes"][str(n)] = measure(n, cfg, base, pool)
    return out


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    sizes = r.get("sizes", {})
    out: list[dict[str, Any]] = []
    one = sizes.get("1")
    biggest = sizes.get(str(max((int(k) for k in sizes), default=1)))
    if one and biggest and biggest is not one:
        a = biggest["publish"]["cpu_s_per_1000_entries_less_idle"]
        b = one["publish"]["cpu_s_per_1000_entries_less_idle"]
        valid = all(x["publish"].get("valid", True) for x in (one, biggest))
        out.append(
            {
                "what": f"CPU per entry less idle, {biggest['groups']} groups / 1 group"
                + ("" if valid else " (a load was sent twice: not a result)"),
                "value": a / b,
                "target": "<= 1.15",
                "met": (a / b <= 1.15) if valid else None,
            }
        )
        a = biggest["publish"]["cpu_s_per_1000_entries"]
        b = one["publish"]["cpu_s_per_1000_entries"]
        out.append(
            {
                "what": f"CPU per entry with idle, {biggest['groups']} groups / 1 group",
                "value": a / b,
                "target": "info",
                "met": None,
            }
        )
        a = biggest["rpc"]["lookup_500"]["p50_ms"]
        b = one["rpc"]["lookup_500"]["p50_ms"]
        out.append(
            {
                "what": f"RPC lookup p50, {biggest['groups']} groups / 1 group",
                "value": a / b,
                "target": "<= 1.5",
                "met": a / b <= 1.5,
            }
        )
    for k, v in sizes.items():
        p50_us = v["mirror"]["lookup_500"]["p50_us"]
        out.append(
            {
                "what": f"mirror lookup p50, {k} group(s) (us)",
                "value": p50_us,
                "target": "<= 100",
                "met": p50_us <= 100,
            }
        )
        lost = v["kills"]["acked_entries_lost"]
        out.append(
            {
                "what": f"acknowledged entries lost, {k} group(s)",
                "value": lost,
                "target": "0",
                "met": lost == 0,
            }
        )
    return out


def markdown(data: dict[str, Any]) -> str:
    from kvdir import report

    r = data["results"]
    lines = ["# kvdir bench directory --shards", "", report.header_markdown(data["header"]), ""]
    if "error" in data:
        lines += ["**The run failed:**", "", "```", data["error"], "```", ""]
    head = (
        "| groups | replicas | publish entries/s | CPU s / 1,000 entries (less idle) | "
        "bytes / entry | "
        "mirror lookup p50 (us) | RPC lookup p50 / p99 (ms) | leader-kill gap median / max (ms) "
        "| acked entries lost | load avg |"
    )
    lines += [head, "|" + "---|" * 10]
    for k, v in r.get("sizes", {}).items():
        p, m, rp, kl = v["publish"], v["mirror"], v["rpc"], v["kills"]
        lines.append(
            f"| {k} | {v['replicas']} | {fmt(p['entries_per_s'])}"
            f"{'' if p.get('valid', True) else ' (RPCs refused: not a result)'} | "
            f"{p['cpu_s_per_1000_entries']:.3f} ({p['cpu_s_per_1000_entries_less_idle']:.3f}) | "
            f"{p['bytes_per_entry']:.0f} | "
            f"{m['lookup_500']['p50_us']:.1f} | {rp['lookup_500']['p50_ms']:.2f} / "
            f"{rp['lookup_500']['p99_ms']:.2f} | {kl['gap_s_median'] * 1e3:.0f} / "
            f"{kl['gap_s_max'] * 1e3:.0f} | {kl['acked_entries_lost']} | "
            f"{p['loadavg'][0][0]:.2f} -> {p['loadavg'][1][0]:.2f} |"
        )
    lines += ["", "## Targets", "", "| what | value | target | met |", "|---|---|---|---|"]
    load = data["header"].get("loadavg_start") or [0.0]
    if load and load[0] > 1.0:
        note = f"**Loaded host (load average {load[0]:.2f} at start): not a result.**"
        lines[-5:-5] = ["", note]
    for t in data.get("targets", []):
        lines.append(f"| {t['what']} | {fmt(t['value'])} | {t['target']} | {fmt(t['met'])} |")
    lines += [
        "",
        "Publish: batches split by owner group on the client, gathered per node into "
        "--publish-batch requests, sent to each group's leader (--publish-inflight per "
        "group); CPU summed over every replica process from before the load until every "
        "replica applied it ('less idle': minus the replicas' CPU rate measured idle just "
        "before, times that span: N groups tick, sweep and heartbeat even with no load). "
        "Bytes per entry: the replicas' RSS growth over the entry copies they hold (3 per "
        "entry). Mirror: a ShardedMirror (one table per group) fed by "
        "every group's Watch, full LookupResponse of a 500-block chain. RPC: "
        "ShardedDirectoryClient.lookup of a 500-block chain, one thread (split, fanned out "
        "in parallel, merged). Kills: a writer of 64-entry chains through the sharded client; "
        "leader SIGKILLs round robin over the groups.",
        "",
    ]
    return "\n".join(lines)


def config_record(cfg: Config) -> dict[str, Any]:
    return {
        "shards": list(cfg.shards),
        "entries": cfg.entries,
        "chain_blocks": CHAIN_BLOCKS,
        "kills": cfg.kills,
        "duration_s": cfg.duration_s,
        "clients": cfg.clients,
        "publish_batch": cfg.publish_batch,
        "publish_inflight_per_group": cfg.publish_inflight,
        "quick": cfg.quick,
    }


def run(cfg: Config) -> int:
    from kvdir import report

    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    data: dict[str, Any] = {"header": report.header(started), "config": config_record(cfg)}
    tmp = None if cfg.data_dir else tempfile.mkdtemp(prefix="kvdir-bench-shards-")
    base = cfg.data_dir or tmp
    assert base is not None
    say(f"replica data and logs under {base}")
    data["results"] = {}
    try:
        data["results"] = run_sizes(cfg, base)
    except Exception as e:
        data["error"] = traceback.format_exc()
        say(f"benchmark failed: {e!r}; replica logs kept under {base}")
    data["header"]["wall_s"] = time.monotonic() - t0
    data["header"]["source_fingerprint_end"] = report.source_fingerprint()
    try:
        data["targets"] = targets(data["results"])
    except (KeyError, ZeroDivisionError) as e:
        data["targets"] = []
        data.setdefault("error", f"no targets: {e!r}")
    md = markdown(data)
    md_path, js_path = report.write(cfg.out_dir, f"directory-shards-{started:%Y-%m-%d}", md, data)
    print(md)
    say(f"wrote {md_path} and {js_path}")
    if tmp is not None and "error" not in data:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if "error" in data else 0
