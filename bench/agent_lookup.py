"""What the vLLM connector's scheduler side pays per lookup: ask the agent, or mirror in process.

Run as ``python -m bench.agent_lookup``. A real 3-replica directory on
127.0.0.1, two holder agents (one holds whole 500-block chains, one the first
half of each), and two reader agents, one with `directory_mirror` on and one
with it off; then four ways of answering the scheduler side's question
("which peers hold more of this 500-block chain than I do?"), interleaved in
rounds so the machine's drift hits each alike:

- ``agent-socket``: the same question over the reader's lookup socket
  (agent/lookup_socket.py: length-prefixed frames, no gRPC), mirror on: what
  the connector does today, with the default agent;
- ``agent-mirror``: EngineLookup over the reader's gRPC engine socket, mirror
  on (what the connector did before the lookup socket);
- ``agent-rpc``: the lookup socket against the reader with the mirror off (each
  Lookup a gRPC call from the agent to a replica);
- ``inproc-mirror``: the connector's own `Mirror` (a Watch stream into the
  engine process), `lookup(..., omit_records=True)` as the agent calls it;
- ``inproc-holders``: the same mirror's lightest read that still names each
  peer's prefix and transports (`holders`, no response message);
- ``direct-rpc``: the connector asking a replica itself, for reference.

Per form: latency, lookups per second from one thread, and CPU per lookup of
each process involved (the caller's thread, the reader agent, the three
replicas), each net of that process's idle rate measured just before. Writes
bench/results/agent-lookup-DATE.{md,json} (or --out-dir).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.host import proc_cpu_s
from bench.measure import ms_stats_from_ns, say
from kvdir import report
from kvdir.agent.engine.client import EngineClient
from kvdir.core.client import DirectoryClient, namespace
from kvdir.core.hashing import block_chain
from kvdir.core.mirror import Mirror
from kvdir.core.mirror_sync import MirrorSync
from kvdir.core.wire import namespace_key
from kvdir.directory.limits import RequestLimits
from kvdir.directory.lookup import Chain
from kvdir.local import LocalAgent, LocalCluster, wait_for

CHAIN_BLOCKS = 500
CHAINS = 4
BLOCK_TOKENS = 16
SLOT_BYTES = 4096
MODEL = "agent-lookup-bench"
NS = namespace(MODEL, BLOCK_TOKENS)
READER_SLOTS = 16
ROUNDS = 3
ROUND_S = 3.0
"""Seconds per form per round: 5 forms x 3 rounds x 3 s, 45 s of timing."""
IDLE_S = 2.0
"""Window over which each process's idle CPU rate is measured before the rounds."""
START_TIMEOUT_S = 90.0
READER_ID = "reader"
"""The node id both readers' lookups exclude (the in-process forms use it too)."""
LOOKUP_NODES = RequestLimits().lookup_nodes_default
"""Peers per answer: what a replica (and the agent's Lookup) gives a request naming none."""
FORMS = (
    "agent-socket", "agent-mirror", "agent-rpc", "inproc-mirror", "inproc-holders", "direct-rpc"
)  # fmt: skip


def _pool(slots: int) -> str:
    return f"model={MODEL},block_tokens={BLOCK_TOKENS},slot_bytes={SLOT_BYTES},slots={slots}"


def chains() -> list[list[bytes]]:
    return [
        block_chain(list(range(c * 10**7, c * 10**7 + CHAIN_BLOCKS * BLOCK_TOKENS)), BLOCK_TOKENS)
        for c in range(CHAINS)
    ]


@dataclass
class World:
    cluster: LocalCluster
    agents: dict[str, LocalAgent]
    engines: dict[str, EngineClient] = field(default_factory=dict)

    def pid(self, name: str) -> int:
        proc = self.agents[name].proc
        assert proc is not None
        return proc.pid

    def replica_pids(self) -> list[int]:
        return [r.proc.pid for r in self.cluster.replicas if r.proc is not None]


def start(base: str) -> World:
    """The directory and the four agents, started; whatever started is stopped on failure."""
    w = World(LocalCluster(str(Path(base, "directory")), size=3), {})
    spec = {
        "whole": (_pool(CHAINS * CHAIN_BLOCKS), []),
        "half": (_pool(CHAINS * CHAIN_BLOCKS // 2), []),
        "reader-on": (_pool(READER_SLOTS), []),
        "reader-off": (_pool(READER_SLOTS), ["--no-directory-mirror"]),
    }
    try:
        w.cluster.start(START_TIMEOUT_S)
        for name, (pool, extra) in spec.items():
            a = w.agents[name] = LocalAgent(
                name, base, w.cluster.grpc_addresses, pool, lease_ms=30_000, extra_args=extra
            )
            a.launch(START_TIMEOUT_S)
            w.engines[name] = EngineClient(a.engine_socket, timeout_s=30)
        w.engines["reader-on-grpc"] = EngineClient(
            w.agents["reader-on"].engine_socket, timeout_s=30, lookup_socket=False
        )
    except BaseException:
        stop(w)
        raise
    return w


def stop(w: World) -> None:
    for e in w.engines.values():
        e.close()
    for a in w.agents.values():
        a.stop()
    w.cluster.stop()


def store(w: World, all_chains: list[list[bytes]]) -> None:
    for holder, blocks in (("whole", CHAIN_BLOCKS), ("half", CHAIN_BLOCKS // 2)):
        e = w.engines[holder]
        for chain in all_chains:
            slots = e.allocate(NS, blocks).slots
            e.stored(NS, chain[:blocks], slots)
        e.flush()
    want = {"whole": CHAIN_BLOCKS, "half": CHAIN_BLOCKS // 2}
    for reader in ("reader-on", "reader-off"):
        for chain in all_chains:
            wait_for(
                partial(_sees, w.engines[reader], chain, want),
                START_TIMEOUT_S,
                f"{reader} to see every chain's holders",
                0.05,
            )


def _sees(e: EngineClient, chain: list[bytes], want: dict[str, int]) -> bool:
    return {p.node_id: p.prefix_blocks for p in e.lookup(NS, chain).peers} == want


def answers(w: World, m: Mirror, c: DirectoryClient, all_chains: list[list[bytes]]) -> int:
    """Chains on which the forms disagree about (peer, prefix) best first."""
    wrong = 0
    for chain in all_chains:
        got = [
            [(p.node_id, p.prefix_blocks) for p in w.engines[r].lookup(NS, chain).peers]
            for r in ("reader-on", "reader-on-grpc", "reader-off")
        ] + [
            [(x.node_id, x.prefix_blocks) for x in resp.matches]
            for resp in (
                m.lookup(NS, chain, exclude_node=READER_ID, omit_records=True),
                c.lookup(NS, chain, exclude_node=READER_ID, omit_records=True),
            )
        ]
        got.append(
            [(n, k) for n, k, _, _ in m.holders(namespace_key(NS), Chain.of(chain), LOOKUP_NODES)]
        )
        wrong += any(g != got[0] for g in got)
    return wrong


@dataclass
class Sample:
    lat_ns: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    caller_cpu_s: float = 0.0
    agent_cpu_s: float = 0.0
    replicas_cpu_s: float = 0.0


def _cpu(pids: list[int]) -> float:
    return sum(x for x in map(proc_cpu_s, pids) if not math.isnan(x))


def timed_round(
    call: Callable[[int], object], agent: list[int], replicas: list[int], n: int, s: Sample
) -> None:
    """ROUND_S seconds of `call(i)` on this thread, CPU of every process counted."""
    a0, r0, c0 = _cpu(agent), _cpu(replicas), time.thread_time()
    t0 = time.perf_counter()
    end, i = t0 + ROUND_S, 0
    while time.perf_counter() < end:
        x = time.perf_counter_ns()
        call(i % n)
        s.lat_ns.append(time.perf_counter_ns() - x)
        i += 1
    s.wall_s += time.perf_counter() - t0
    s.caller_cpu_s += time.thread_time() - c0
    s.agent_cpu_s += _cpu(agent) - a0
    s.replicas_cpu_s += _cpu(replicas) - r0


def idle_rate(pids: list[int]) -> float:
    """CPU seconds per second of `pids` at rest (heartbeats, Watch streams, Raft)."""
    before = _cpu(pids)
    time.sleep(IDLE_S)  # a measurement window, not a wait for a condition
    return (_cpu(pids) - before) / IDLE_S


def summary(s: Sample, idle_agent: float, idle_replicas: float) -> dict[str, Any]:
    n = len(s.lat_ns)
    per = 1e6 / n if n else math.nan
    agent = max(0.0, s.agent_cpu_s - idle_agent * s.wall_s) * per
    replicas = max(0.0, s.replicas_cpu_s - idle_replicas * s.wall_s) * per
    caller = s.caller_cpu_s * per
    return {
        **ms_stats_from_ns(s.lat_ns),
        "lookups_per_s": n / s.wall_s if s.wall_s else math.nan,
        "caller_cpu_us_per_lookup": caller,
        "agent_cpu_us_per_lookup": agent,
        "replicas_cpu_us_per_lookup": replicas,
        "total_cpu_us_per_lookup": caller + agent + replicas,
        "raw_cpu_s": {
            "caller": s.caller_cpu_s,
            "agent": s.agent_cpu_s,
            "replicas": s.replicas_cpu_s,
            "wall": s.wall_s,
        },
    }


def forms_of(
    w: World, m: Mirror, c: DirectoryClient, all_chains: list[list[bytes]]
) -> dict[str, tuple[Callable[[int], object], str]]:
    """Each form's call, and the reader agent it runs through ("" for none)."""
    on, off = w.engines["reader-on"], w.engines["reader-off"]
    on_grpc = w.engines["reader-on-grpc"]
    key = namespace_key(NS)
    return {
        "agent-socket": (lambda i: on.lookup(NS, all_chains[i]), "reader-on"),
        "agent-mirror": (lambda i: on_grpc.lookup(NS, all_chains[i]), "reader-on"),
        "agent-rpc": (lambda i: off.lookup(NS, all_chains[i]), "reader-off"),
        "inproc-mirror": (
            lambda i: m.lookup(NS, all_chains[i], exclude_node=READER_ID, omit_records=True),
            "",
        ),
        "inproc-holders": (lambda i: m.holders(key, Chain.of(all_chains[i]), LOOKUP_NODES), ""),
        "direct-rpc": (
            lambda i: c.lookup(NS, all_chains[i], exclude_node=READER_ID, omit_records=True),
            "",
        ),
    }


def rounds(
    w: World, forms: dict[str, tuple[Callable[[int], object], str]], n: int
) -> dict[str, Any]:
    replicas = w.replica_pids()
    idle = {a: idle_rate([w.pid(a)]) for a in ("reader-on", "reader-off")}
    idle["replicas"] = idle_rate(replicas)
    samples = {f: Sample() for f in FORMS}
    for r in range(ROUNDS):
        say(f"round {r + 1} of {ROUNDS}")
        for f in FORMS if r % 2 == 0 else tuple(reversed(FORMS)):  # A B C D D C B A ...
            call, agent = forms[f]
            timed_round(call, [w.pid(agent)] if agent else [], replicas, n, samples[f])
    out = {f: summary(samples[f], idle.get(forms[f][1], 0.0), idle["replicas"]) for f in FORMS}
    return {"idle_cpu_s_per_s": idle, "forms": out}


def measure(w: World) -> dict[str, Any]:
    all_chains = chains()
    say("storing the chains")
    store(w, all_chains)
    client = DirectoryClient(w.cluster.grpc_addresses, timeout_s=10)
    mirror = Mirror(namespaces=[NS])
    sync = MirrorSync(mirror, w.cluster.grpc_addresses).start()
    try:
        wait_for(mirror.fresh, START_TIMEOUT_S, "the in-process mirror", 0.05)
        wrong = answers(w, mirror, client, all_chains)
        say(f"the forms agree on {CHAINS - wrong} of {CHAINS} chains")
        timed = rounds(w, forms_of(w, mirror, client, all_chains), len(all_chains))
        page = scrape_mirror(w.agents["reader-on"])
    finally:
        sync.stop()
        client.close()
    return {
        "chain_blocks": CHAIN_BLOCKS,
        "chains": CHAINS,
        "holders": 2,
        "wrong_answers": wrong,
        **timed,
        "reader_on_mirror_metrics": page,
    }


def scrape_mirror(agent: LocalAgent) -> dict[str, float]:
    """The reader's kvdir_agent_mirror_* samples (who answered its lookups)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{agent.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvdir_agent_mirror_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


ROWS = (
    ("agent-socket", "EngineLookup over the agent's lookup socket (no gRPC), agent mirror on"),
    ("agent-mirror", "EngineLookup over the agent's gRPC socket, agent mirror on"),
    ("agent-rpc", "EngineLookup over the lookup socket, agent mirror off (gRPC to a replica)"),
    ("inproc-mirror", "a Mirror inside the caller (no agent), the Lookup message"),
    ("inproc-holders", "a Mirror inside the caller, holders() (no message)"),
    ("direct-rpc", "the caller's own gRPC Lookup to a replica (no agent)"),
)


def markdown(h: dict[str, Any], res: dict[str, Any]) -> str:
    f = res["forms"]
    rows = [
        (
            name,
            what,
            f[name]["p50_ms"],
            f[name]["p99_ms"],
            f[name]["lookups_per_s"],
            f[name]["caller_cpu_us_per_lookup"],
            f[name]["agent_cpu_us_per_lookup"],
            f[name]["replicas_cpu_us_per_lookup"],
            f[name]["total_cpu_us_per_lookup"],
        )
        for name, what in ROWS
    ]
    head = [
        "form",
        "what",
        "p50 ms",
        "p99 ms",
        "lookups/s (1 thread)",
        "caller CPU us",
        "agent CPU us",
        "replicas CPU us",
        "total CPU us",
    ]
    idle = res["idle_cpu_s_per_s"]
    method = (
        f"{CHAINS} chains of {CHAIN_BLOCKS} blocks, each held whole by one agent and half "
        "by another (two peers per answer; records omitted, as the agent's Lookup asks); "
        f"one calling thread; {ROUNDS} rounds of {ROUND_S:.0f} s per form, interleaved. "
        "CPU per lookup: each process's CPU time over the form's rounds divided by its "
        f"lookups, net of its idle rate (reader-on {idle['reader-on']:.3f}, reader-off "
        f"{idle['reader-off']:.3f}, replicas {idle['replicas']:.3f} CPU-s/s). "
        f"Wrong answers (forms disagreeing on the peers): {res['wrong_answers']}. "
        "Load average at the end: " + " / ".join(f"{x:.2f}" for x in h["loadavg_end"]) + "."
    )
    title = (
        "# Scheduler-side lookups: through the agent, or a mirror in process "
        f"({CHAIN_BLOCKS}-block chains)"
    )
    parts = [title, report.header_markdown(h), method, report.table(rows, head)]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.agent_lookup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out-dir", help="where agent-lookup-DATE.{md,json} go (bench/results)")
    args = p.parse_args(argv)
    args.out_dir_given = args.out_dir is not None
    args.out_dir = args.out_dir or str(Path(__file__).parent / "results")
    started = dt.datetime.now(dt.UTC)
    h = report.header(started)
    h["command"] = "python -m bench.agent_lookup" + (" --out-dir OUT" * args.out_dir_given)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvdir-agent-lookup-") as base:
        say("starting 3 replicas and 4 agents on 127.0.0.1")
        w = start(base)
        try:
            res = measure(w)
        finally:
            stop(w)
    h["wall_s"] = time.monotonic() - t0
    h["loadavg_end"] = os.getloadavg()
    md = markdown(h, res)
    stem = f"agent-lookup-{started:%Y-%m-%d}"
    report.write(Path(args.out_dir), stem, md, {**h, **res})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
