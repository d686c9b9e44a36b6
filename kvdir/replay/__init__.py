"""`kvdir bench replay`: the seed's cluster experiment on a real trace, with real components.

A real 3-replica directory and N real agents (one per simulated node, each
with a shared-memory pool) replay a Mooncake-format trace; every block is
real bytes stored in a slot and every pull a validated `Fetch` between
agents. Only the GPU is simulated (`gpu.GpuModel`, calibrated on the H200
figures of ../shared/MISSION.md): each node is `--gpus-per-node` FIFO servers
with one LRU KV cache of finite capacity. Scenarios, side by side:

  A       local cache only, random routing
  B       pull over TCP (bytes really move over loopback TCP), random routing
  C       pool over shm (same host; the fastest transport here), random routing
  C-rdma  the same pool timed as RDMA at 400 Gbit/s line rate (modelled; bytes over shm)
  D       affinity routing (bounded imbalance) + pool, timed as RDMA (modelled)
  ideal   infinite global cache, from the trace alone

plus hit rate versus cluster size (`--sweep-nodes`, model-only: the same
replay loop over an in-process index instead of agents, which the 16-node
real run cross-checks). See docs/replay.md for the definitions.
Results: Markdown on stdout and `--out`/replay-DATE.{md,json,-ttft.png,-nodes.png}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdir import report
from kvdir.agent.engine.client import EngineError
from kvdir.core.client import DirectoryClient, DirectoryError
from kvdir.local import ClusterError
from kvdir.replay import plots, results
from kvdir.replay.gpu import DECODE_BATCH_DEFAULT, GpuModel, ModelError
from kvdir.replay.progress import Progress
from kvdir.replay.sim import (
    SCENARIOS,
    Outcome,
    Replay,
    Setup,
    ideal,
    model_replay,
)
from kvdir.replay.trace import (
    TRACE_BLOCK_TOKENS,
    Request,
    TraceError,
    compress,
    read_trace,
    reusable_blocks,
    synthesize,
)

DEFAULT_SCENARIOS = ("A", "B", "C", "C-rdma", "D")
NODES_MAX = 64
SWEEP_DEFAULT = (2, 4, 8, 16, 32)
SWEEP_SCENARIOS = ("A", "C", "D")
GIB = 1 << 30


class ReplayError(ValueError):
    """Bad settings: the CLI prints the message and exits non-zero."""


RUN_ERRORS: tuple[type[Exception], ...] = (EngineError, ClusterError, DirectoryError, OSError)
"""What a failing real component raises (an agent or replica gone, a pool file lost)."""


@dataclass
class Settings:
    trace: str | None = None
    """Mooncake-format JSONL; None: the deterministic synthetic trace (trace.synthesize)."""
    limit: int = 1_000_000
    start_s: float = 0.0
    nodes: int = 16
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    speedup: float = 8.0
    model: str = "llama-70b"
    gpus_per_node: int = 8
    kv_gib_per_node: float = 1024.0
    decode_batch: int = DECODE_BATCH_DEFAULT
    block_bytes: int = 4096
    seed: int = 1
    sweep: tuple[int, ...] = SWEEP_DEFAULT
    real: bool = True
    progress: bool = True
    synth_conversations: int = 120

    def check(self) -> None:
        if not 1 <= self.nodes <= NODES_MAX:
            raise ReplayError(f"--nodes must be 1..{NODES_MAX}")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad or not self.scenarios:
            raise ReplayError(f"unknown scenarios {bad}; known: {', '.join(SCENARIOS)}")
        if any(not 1 <= n <= NODES_MAX for n in self.sweep):
            raise ReplayError(f"--sweep-nodes values must be 1..{NODES_MAX}")
        if self.speedup <= 0 or self.kv_gib_per_node <= 0 or self.limit <= 0:
            raise ReplayError("--speedup, --kv-gib-per-node and --limit must be > 0")
        if self.gpus_per_node <= 0 or self.decode_batch <= 0:
            raise ReplayError("--gpus-per-node and --decode-batch must be > 0")
        if self.block_bytes < 64 or self.block_bytes % 16:
            raise ReplayError("--block-bytes must be a multiple of 16, at least 64")


@dataclass
class Report:
    settings: Settings
    setup: Setup
    requests: int
    rows: list[dict[str, Any]]
    sweep: dict[str, dict[int, float]]
    expected_a: float
    model_check: dict[str, dict[str, float]] = field(default_factory=dict)
    targets: list[report.Target] = field(default_factory=list)
    wall_s: float = 0.0

    def markdown(self) -> str:
        out = [
            "### Scenarios",
            "",
            results.main_table(self.rows),
            "",
            "### Mean TTFT by conversation turn",
            "",
            results.turn_table(self.rows),
            "",
        ]
        if self.settings.real:
            out += ["### Real operations", "", results.real_table(self.rows), ""]
        if self.model_check:
            rows = [
                (k, f"{v['real'] * 100:.2f}%", f"{v['model'] * 100:.2f}%")
                for k, v in self.model_check.items()
            ]
            out += [
                "### Cross-check: real pools vs the model-only replay (same seed)",
                "",
                report.table(rows, ["scenario", "hit rate, real agents", "hit rate, model only"]),
                "",
            ]
        if self.sweep:
            ns = sorted({n for p in self.sweep.values() for n in p})
            rows2 = [(k, *(f"{p[n] * 100:.1f}%" for n in ns)) for k, p in self.sweep.items()]
            out += [
                "### Hit rate versus nodes (model-only replay)",
                "",
                report.table(rows2, ["scenario", *(f"{n} nodes" for n in ns)]),
                "",
            ]
        if self.targets:
            out += ["### Targets", "", report.targets_table(self.targets), ""]
        return "\n".join(out)


def load_requests(s: Settings) -> list[Request]:
    if s.trace is None:
        reqs = synthesize(conversations=s.synth_conversations, seed=s.seed)[: s.limit]
    else:
        reqs = read_trace(s.trace, s.limit, s.start_s)
    return compress(reqs, s.speedup)


def make_setup(s: Settings, requests: Sequence[Request], nodes: int | None = None) -> Setup:
    try:
        gpu = GpuModel.of(s.model, TRACE_BLOCK_TOKENS, s.decode_batch)
    except ModelError as e:
        raise ReplayError(str(e)) from e
    capacity = int(s.kv_gib_per_node * GIB // gpu.cost.block_bytes())
    longest = max(len(r.hash_ids) for r in requests)
    if capacity < longest:
        raise ReplayError(
            f"--kv-gib-per-node {s.kv_gib_per_node:g} holds {capacity} blocks of "
            f"{gpu.cost.block_bytes() / 2**20:.0f} MiB, less than the longest request "
            f"({longest} blocks)"
        )
    return Setup(gpu, nodes or s.nodes, capacity, s.gpus_per_node, s.seed)


def _tick(s: Settings, what: str, total: int) -> Callable[[int], None] | None:
    return Progress(what, total) if s.progress else None


def run_real(
    s: Settings, setup: Setup, requests: Sequence[Request], reusable: Sequence[int]
) -> list[Outcome]:
    """Every scenario on fresh agents (empty pools) against one real directory."""
    from kvdir.local import LocalCluster

    with (
        tempfile.TemporaryDirectory(prefix="kvdir-replay-") as tmp,
        LocalCluster(tmp, size=3) as cluster,
    ):
        cluster.start()
        with cluster.client(timeout_s=10) as dc:
            return [
                _run_scenario(s, setup, key, cluster.grpc_addresses, dc, requests, reusable)
                for key in s.scenarios
            ]


def _run_scenario(
    s: Settings,
    setup: Setup,
    key: str,
    addresses: Sequence[str],
    dc: DirectoryClient,
    requests: Sequence[Request],
    reusable: Sequence[int],
) -> Outcome:
    from kvdir.replay.real import RealBackend, shm_base, start_agents, stop_agents

    sc, model = SCENARIOS[key], f"replay-{key}"
    with tempfile.TemporaryDirectory(prefix="kvdir-replay-", dir=shm_base()) as pool_dir:
        agents = start_agents(
            pool_dir,
            addresses,
            setup.nodes,
            model,
            TRACE_BLOCK_TOKENS,
            s.block_bytes,
            setup.capacity_blocks,
            sc.agent_transports,
        )
        try:
            backend = RealBackend(agents, dc, model, TRACE_BLOCK_TOKENS, s.block_bytes)
            try:
                tick = _tick(s, key, len(requests))
                return Replay(sc, setup, backend).run(requests, reusable, tick)
            finally:
                backend.close()
        finally:
            stop_agents(agents)


def hit_rate(o: Outcome) -> float:
    reusable = sum(x.reusable for x in o.served)
    return (
        sum(min(x.local + x.pulled, x.reusable) for x in o.served) / reusable if reusable else 0.0
    )


def nodes_sweep(
    s: Settings, requests: Sequence[Request], reusable: Sequence[int]
) -> dict[str, dict[int, float]]:
    """Hit rate per node count for A, C and D (those of them that were asked for)."""
    keys = [k for k in SWEEP_SCENARIOS if k in s.scenarios] if s.sweep else []
    tick = _tick(s, "sweep", len(keys) * len(s.sweep))
    out: dict[str, dict[int, float]] = {}
    for i, key in enumerate(keys):
        points = out.setdefault(SCENARIOS[key].label, {})
        for j, n in enumerate(s.sweep):
            setup = make_setup(s, requests, n)
            points[n] = hit_rate(model_replay(SCENARIOS[key], requests, reusable, setup))
            if tick is not None:
                tick(i * len(s.sweep) + j + 1)
    return out


def replay(s: Settings) -> Report:
    s.check()
    t0 = time.monotonic()
    requests = load_requests(s)
    reusable = reusable_blocks(requests)
    setup = make_setup(s, requests)
    gpus = setup.nodes * setup.gpus_per_node
    if s.real:
        outcomes = run_real(s, setup, requests, reusable)
    else:
        outcomes = [model_replay(SCENARIOS[k], requests, reusable, setup) for k in s.scenarios]
    rows = [results.summarize(o, setup.gpu, gpus) for o in outcomes]
    rows.append(results.summarize(ideal(requests, reusable, setup), setup.gpu, gpus))
    check: dict[str, dict[str, float]] = {}
    if s.real:
        for o in outcomes:
            m = model_replay(SCENARIOS[o.scenario], requests, reusable, setup)
            check[o.scenario] = {"real": hit_rate(o), "model": hit_rate(m)}
    sweep = nodes_sweep(s, requests, reusable)
    expected_a = results.expected_local_hit_rate(requests, reusable, setup.nodes)
    rep = Report(s, setup, len(requests), rows, sweep, expected_a, check)
    rep.targets = results.targets(rows, expected_a)
    rep.wall_s = time.monotonic() - t0
    return rep


def settings_table(rep: Report) -> str:
    s, g = rep.settings, rep.setup.gpu
    rows = [
        (
            "trace",
            s.trace or f"synthetic ({s.synth_conversations} conversations, seed {s.seed})",
        ),
        ("requests", f"{rep.requests:,} (limit {s.limit:,}, from {s.start_s:g} s)"),
        ("time compression", f"{s.speedup:g}x (simulated arrivals {s.speedup:g} times denser)"),
        ("nodes", f"{rep.setup.nodes} x {s.gpus_per_node} GPUs (each GPU a FIFO server)"),
        (
            "model shape",
            f"{g.cost.shape.name}: {g.cost.shape.kv_bytes_per_token // 1024} KiB KV/token, "
            f"{g.block_tokens}-token blocks of {g.cost.block_bytes() / 2**20:.0f} MiB; prefill "
            f"{g.cost.prefill.linear_s * 1e6:.1f} us/token"
            f" + {g.cost.prefill.quadratic_s * 1e9:.2f} ns/token^2; decode batch {s.decode_batch}",
        ),
        (
            "KV cache per node",
            f"{s.kv_gib_per_node:g} GiB = {rep.setup.capacity_blocks:,} blocks,"
            " LRU (suffixes first)",
        ),
        (
            "real pools",
            f"{rep.setup.capacity_blocks:,} slots of {s.block_bytes:,} B per agent "
            f"(KV scaled down {g.cost.block_bytes() // s.block_bytes:,}x)"
            if s.real
            else "none (model only)",
        ),
        (
            "links (timing)",
            "tcp 46.8 ms / 128 MiB; shm 1.5 TB/s + 0.65 ms; rdma 50 GB/s (modelled)",
        ),
        ("routing seed", str(s.seed)),
    ]
    return report.table(rows, ["setting", "value"])


def document(rep: Report, head: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"# kvdir bench replay: {rep.setup.nodes} nodes",
            "",
            report.header_markdown(head),
            "",
            settings_table(rep),
            "",
            rep.markdown(),
        ]
    )


def as_json(rep: Report, head: dict[str, Any]) -> dict[str, Any]:
    rows = [{k: v for k, v in r.items() if k != "ttft_sorted_s"} for r in rep.rows]
    return {
        "header": head,
        "settings": vars(rep.settings),
        "capacity_blocks": rep.setup.capacity_blocks,
        "requests": rep.requests,
        "scenarios": rows,
        "expected_local_hit_rate": rep.expected_a,
        "model_check": rep.model_check,
        "sweep": {k: {str(n): v for n, v in p.items()} for k, p in rep.sweep.items()},
        "targets": [t.as_dict() for t in rep.targets],
    }


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "replay",
        help="the seed's cluster experiment: replay a trace over real agents, simulated GPUs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Settings()
    p.add_argument("--trace", help="Mooncake-format JSONL (default: a synthetic trace)")
    p.add_argument("--limit", type=int, default=d.limit, help="at most this many requests")
    p.add_argument("--start-s", type=float, default=0.0, help="skip requests before this time")
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--scenarios", default=",".join(d.scenarios))
    p.add_argument("--speedup", type=float, default=d.speedup, help="trace time compression")
    p.add_argument("--model", default=d.model, help="model shape: llama-70b or llama-3-8b")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--kv-gib-per-node", type=float, default=d.kv_gib_per_node)
    p.add_argument("--decode-batch", type=int, default=d.decode_batch)
    p.add_argument("--block-bytes", type=int, default=d.block_bytes, help="real bytes per block")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--sweep-nodes",
        default=",".join(map(str, d.sweep)),
        help="node counts for the hit-rate sweep (model-only; empty: none)",
    )
    p.add_argument("--model-only", action="store_true", help="no processes: the model backend")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    p.add_argument("--stem", help="file name stem (default replay-DATE)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ReplayError(f"{what}: expected comma-separated integers, got {text!r}") from None


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(
        trace=args.trace,
        limit=args.limit,
        start_s=args.start_s,
        nodes=args.nodes,
        scenarios=tuple(x.strip() for x in args.scenarios.split(",") if x.strip()),
        speedup=args.speedup,
        model=args.model,
        gpus_per_node=args.gpus_per_node,
        kv_gib_per_node=args.kv_gib_per_node,
        decode_batch=args.decode_batch,
        block_bytes=args.block_bytes,
        seed=args.seed,
        sweep=_ints(args.sweep_nodes, "--sweep-nodes"),
        real=not args.model_only,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.UTC)
    try:
        rep = replay(settings_of(args))
    except (ReplayError, TraceError) as e:
        print(f"kvdir bench replay: {e}", file=sys.stderr)
        return 2
    except RUN_ERRORS as e:
        print(f"kvdir bench replay: the real cluster failed: {e}", file=sys.stderr)
        return 1
    head = report.header(started)
    head["wall_s"] = rep.wall_s
    head["source_fingerprint_end"] = report.source_fingerprint()
    stem = args.stem or f"replay-{started:%Y-%m-%d}"
    out = Path(args.out)
    md = document(rep, head)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{rep.requests:,} requests, {rep.setup.nodes} nodes"
    png_ttft = plots.ttft_cdf(rep.rows, out / f"{stem}-ttft.png", f"TTFT CDF: {title}")
    md += f"\n![TTFT CDF]({png_ttft.name})\n"
    if rep.sweep:
        png_nodes = plots.hit_vs_nodes(rep.sweep, out / f"{stem}-nodes.png", "Hit rate vs nodes")
        md += f"\n![hit rate versus nodes]({png_nodes.name})\n"
    report.write(out, stem, md, as_json(rep, head))
    print(md)
    failed = [t for t in rep.targets if t.passed is False]
    print(
        f"wrote {out / stem}.{{md,json}} and PNGs; {len(failed)} target(s) missed", file=sys.stderr
    )
    return 0


__all__ = ["ReplayError", "Report", "Settings", "add_parser", "replay"]
