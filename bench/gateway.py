"""`kvdir bench gateway`: the latency `kvdir gateway` adds, next to a plain pass-through proxy.

Both proxies are the same program on the same stack (`kvdir gateway`, aiohttp
on uvloop, one process each); the pass-through one has `passthrough = true`
(round-robin, the body never parsed). The routing one parses the request,
keys the prompt's blocks, asks a real directory replica (one Raft member on
loopback) and routes with `affinity+pool`. Behind both: the same echo
backends (`kvdir.gateway.echo_backend --fixed`, separate processes).

Load: an open-loop client (aiohttp, uvloop) sends `--rate` requests/s of
`--prompt-tokens`-token prompts as token ids (`/v1/completions`, 200 distinct
prompts over 32 shared 6k-token prefixes, each prefix published in the
directory on one backend's node). Latency runs from each request's
*scheduled* send time to its whole response, so a stalled proxy cannot hide
its queue. The phases alternate pass-through / gateway for `--rounds`
rounds; the first `--warmup-s` of each phase is not counted.

With `--workers N` both proxies run N processes on their port
(`workers = N`, SO_REUSEPORT), so the comparison stays like for like. CPU
per request: each phase reads the proxies' own `process_cpu_seconds_total`
(every worker's, at its own port) and the backends' and load generator's CPU
from /proc, and the machine's busy share, so a shared host shows.

Target (issue 6): added latency p99 <= 2 ms over the pass-through at 500
requests/s of 8k-token prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import http.client
import json
import math
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import measure
from bench.gateway_cpu import PhaseCpu, cpu_summary, metric
from kvdir import report

TARGET_ADDED_P99_MS = 2.0
FAILURE_KINDS_MAX = 3
"""Kinds of failed requests a phase reports (the most frequent)."""
MODEL = "bench-model"
BLOCK_TOKENS = 16


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    f = open(log, "wb")  # noqa: SIM115 - the child's stdout/stderr for its whole life
    return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT)


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException) as e:
            # HTTPException: polling a port nobody listens on yet can connect the socket to
            # itself (TCP self-connect in the ephemeral range), which reads its own request.
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s: {last}")


def _toml(cfg: dict[str, Any]) -> str:
    lines = []
    for k, v in cfg.items():
        if not isinstance(v, list) or not v or not isinstance(v[0], dict):
            lines.append(f"{k} = {json.dumps(v)}")
    for k, v in cfg.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            for t in v:
                lines.append(f"\n[[{k}]]")
                lines.extend(f"{kk} = {json.dumps(vv)}" for kk, vv in t.items())
    return "\n".join(lines) + "\n"


async def _load(
    url: str, bodies: list[bytes], rate: float, seconds: float
) -> tuple[list[float], collections.Counter[str]]:
    """Open-loop: request i is due at start + i / rate; latency from due time to response end.

    A failed request (overload: a refused connection, a 503) is infinitely late in the
    latencies, so a tail that fails cannot look fast; the failures come back by kind."""
    import aiohttp

    n = int(rate * seconds)
    lat: list[float] = [math.inf] * n
    errors: collections.Counter[str] = collections.Counter()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one(i: int, due: float) -> None:
            try:
                async with s.post(
                    url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
                ) as r:
                    body = await r.read()
                    if r.status != 200:
                        errors[f"HTTP {r.status}: {body[:200]!r}"] += 1
                        return
            except aiohttp.ClientError as e:
                errors[f"{type(e).__name__}: {e}"] += 1
                return
            lat[i] = time.perf_counter() - due

        start = time.perf_counter() + 0.05
        tasks = []
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, due)))
        await asyncio.gather(*tasks)
    return lat, errors


GATEWAY_STATS = (measure.P50, measure.P90, measure.P99, measure.P999, measure.MAX)


def _stats(xs: list[float]) -> dict[str, float]:
    """Latencies in seconds, reported in ms (n, p50, p90, p99, p99.9, max)."""
    return measure.ms_stats_from_s(xs, GATEWAY_STATS)


def run(args: argparse.Namespace) -> int:
    from kvdir.core.client import DirectoryClient
    from kvdir.core.hashing import block_chain
    from kvdir.gateway.chain import model_namespace
    from kvdir.gateway.config import ModelConfig
    from kvdir.local import LocalCluster, free_port_run

    started = dt.datetime.now(dt.UTC)
    head = report.header(started)
    rng = random.Random(args.seed)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-gw-") as tmp:
        base = Path(tmp)
        cluster = LocalCluster(str(base / "dir"), size=1)
        try:
            cluster.start(timeout_s=60)
            # one run of ports: backends, both proxies' ports, then each one's workers'
            n_workers = args.workers
            first = free_port_run(args.backends + 2 + 2 * n_workers)
            ports = list(range(first, first + args.backends + 2))
            bases = {"gateway": ports[-1] + 1, "passthrough": ports[-1] + 1 + n_workers}
            worker_ports = {k: list(range(b, b + n_workers)) for k, b in bases.items()}
            names = [f"bench-b{i}" for i in range(args.backends)]
            for name, port in zip(names, ports, strict=False):
                procs.append(
                    _spawn(
                        [
                            "-m",
                            "kvdir.gateway.echo_backend",
                            "--port",
                            str(port),
                            "--name",
                            name,
                            "--fixed",
                        ],
                        base / f"{name}.log",
                    )
                )
            for port in ports[: args.backends]:
                _wait_http(f"http://127.0.0.1:{port}/health", 30)

            # Prompts: 32 shared prefixes (6k tokens), each held by one backend's node.
            model = ModelConfig(MODEL, block_tokens=BLOCK_TOKENS, hash="kvdir")
            ns = model_namespace(model)
            prefix_len = min(6144, args.prompt_tokens)
            prefixes = [[rng.randrange(1, 32000) for _ in range(prefix_len)] for _ in range(32)]
            client = DirectoryClient(cluster.grpc_addresses, timeout_s=10)
            for name in names:
                client.register_node(name, "127.0.0.1", 1, "", ["tcp"], 600_000)
            for j, pre in enumerate(prefixes):
                chain = block_chain(pre, BLOCK_TOKENS)
                holder = names[j % len(names)]
                n = len(chain)
                client.publish(holder, 1, ns, 1, chain, [0] * n, [0] * n, [0] * n, [1] * n)
            client.close()
            bodies = []
            for i in range(200):
                pre = prefixes[i % len(prefixes)]
                tail = [rng.randrange(1, 32000) for _ in range(args.prompt_tokens - len(pre))]
                bodies.append(
                    json.dumps({"model": MODEL, "prompt": pre + tail, "max_tokens": 1}).encode()
                )

            gw_port, pt_port = ports[args.backends :]
            common = {
                "directory": cluster.grpc_addresses,
                "log_format": "text",
                "health_interval_s": 5.0,
                "workers": n_workers,
                "backends": [
                    {
                        "url": f"http://127.0.0.1:{p}",
                        "node_id": n,
                        "host": "127.0.0.1",
                        "transports": ["tcp"],
                        "max_concurrency": 4096,
                    }
                    for n, p in zip(names, ports, strict=False)
                ],
                "models": [
                    {"name": MODEL, "block_tokens": BLOCK_TOKENS, "hash": "kvdir"},
                ],
            }
            for port, extra, stem in (
                (gw_port, {"policy": args.policy}, "gateway"),
                (pt_port, {"passthrough": True}, "passthrough"),
            ):
                cfg = {
                    "listen": f"127.0.0.1:{port}",
                    "worker_port_base": bases[stem],
                    **extra,
                    **common,
                }
                path = base / f"{stem}.toml"
                path.write_text(_toml(cfg))
                procs.append(
                    _spawn(
                        ["-m", "kvdir.cli", "gateway", "--config", str(path)], base / f"{stem}.log"
                    )
                )
            for port in (gw_port, pt_port, *worker_ports["gateway"], *worker_ports["passthrough"]):
                _wait_http(f"http://127.0.0.1:{port}/health", 60)
            backend_pids = [p.pid for p in procs[: args.backends]]
            cpu = {k: PhaseCpu(v, backend_pids) for k, v in worker_ports.items()}
            phases: list[dict[str, Any]] = []

            try:
                import uvloop

                runner: Any = uvloop.run
            except ImportError:
                runner = asyncio.run

            def measure(rate: float) -> dict[str, list[float]]:
                out: dict[str, list[float]] = {"passthrough": [], "gateway": []}
                skip = int(rate * args.warmup_s)
                for _ in range(args.rounds):
                    for stem, port in (("passthrough", pt_port), ("gateway", gw_port)):
                        url = f"http://127.0.0.1:{port}/v1/completions"
                        cpu[stem].start()
                        lat, errors = runner(_load(url, bodies, rate, args.seconds + args.warmup_s))
                        phases.append(
                            {
                                "proxy": stem,
                                "rate": rate,
                                **cpu[stem].stop(len(lat)),
                                "failed": errors.total(),
                                "failures": dict(errors.most_common(FAILURE_KINDS_MAX)),
                            }
                        )
                        out[stem].extend(lat[skip:])
                return out

            samples = measure(args.rate)
            extra = {r: measure(r) for r in args.extra_rates}
            gw_ports = worker_ports["gateway"]

            def total(name: str) -> float:  # summed over the gateway's workers
                return sum(metric(p, name) for p in gw_ports)

            server_added_s = total("kvdir_gateway_added_seconds_sum") / max(
                1.0, total("kvdir_gateway_added_seconds_count")
            )
            decisions = total("kvdir_gateway_decisions_total")
            hit_tokens = total("kvdir_gateway_predicted_hit_tokens_total")
            prompt_tokens = total("kvdir_gateway_prompt_tokens_total")
            degraded = total("kvdir_gateway_degraded_decisions_total")
            mirror_share = total('kvdir_gateway_mirror_lookups{source="mirror"}') / max(
                1.0, total("kvdir_gateway_mirror_lookups")
            )
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            cluster.stop()
    head["wall_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    pt, gw = _stats(samples["passthrough"]), _stats(samples["gateway"])
    added = {k: gw[k] - pt[k] for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")}
    targets = [
        report.at_most(
            "added_p99_ms",
            f"added latency p99 at {args.rate:g} req/s, {args.prompt_tokens}-token prompts",
            added["p99_ms"],
            TARGET_ADDED_P99_MS,
            "ms",
        )
    ]
    rows: list[tuple[str, ...]] = [
        (
            name,
            f"{int(s['n']):,}",
            f"{s['p50_ms']:.2f}",
            f"{s['p90_ms']:.2f}",
            f"{s['p99_ms']:.2f}",
            f"{s['p999_ms']:.2f}",
            f"{s['max_ms']:.2f}",
        )
        for name, s in (("pass-through proxy", pt), (f"kvdir gateway ({args.policy})", gw))
    ]
    rows.append(
        (
            "added (gateway - pass-through)",
            "",
            f"{added['p50_ms']:.2f}",
            f"{added['p90_ms']:.2f}",
            f"{added['p99_ms']:.2f}",
            f"{added['p999_ms']:.2f}",
            "",
        )
    )
    extra_rows = []
    extra_data = []
    for r, smp in extra.items():
        e_pt, e_gw = _stats(smp["passthrough"]), _stats(smp["gateway"])
        e_added = {k: e_gw[k] - e_pt[k] for k in ("p50_ms", "p99_ms")}
        extra_data.append({"rate": r, "passthrough": e_pt, "gateway": e_gw, "added": e_added})
        extra_rows.append(
            (
                f"{r:g}",
                f"{e_pt['p50_ms']:.2f}",
                f"{e_pt['p99_ms']:.2f}",
                f"{e_gw['p50_ms']:.2f}",
                f"{e_gw['p99_ms']:.2f}",
                f"{e_added['p50_ms']:.2f}",
                f"{e_added['p99_ms']:.2f}",
            )
        )
    extra_md = (
        [
            "Other rates (informational; same processes, measured after the target rate):\n\n"
            + report.table(
                extra_rows,
                [
                    "requests/s",
                    "pass-through p50 ms",
                    "pass-through p99 ms",
                    "gateway p50 ms",
                    "gateway p99 ms",
                    "added p50 ms",
                    "added p99 ms",
                ],
            )
        ]
        if extra_rows
        else []
    )
    cpu_md, cpu_data = cpu_summary(phases, args.rate)
    md = (
        "\n\n".join(
            [
                "# kvdir bench gateway",
                report.header_markdown(head),
                __doc__ or "",
                *([f"**Note:** {args.note}"] if args.note else []),
                f"{args.workers} worker process(es) per proxy; "
                f"{args.backends} echo backends; {args.rounds} rounds of {args.seconds:g} s "
                f"per proxy at {args.rate:g} requests/s (plus {args.warmup_s:g} s warm-up each); "
                f"the gateway took {int(decisions):,} decisions ({int(degraded)} degraded), "
                f"predicted {hit_tokens / max(prompt_tokens, 1):.3f} of prompt tokens cached, "
                f"{mirror_share:.3f} of lookups answered by its in-process mirror; "
                f"its own mean added time (arrival to backend request, /metrics): "
                f"{server_added_s * 1e3:.3f} ms.",
                report.targets_table(targets),
                report.table(
                    rows, ["", "requests", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"]
                ),
                cpu_md,
                *extra_md,
            ]
        )
        + "\n"
    )
    data = {
        "header": head,
        "targets": [t.as_dict() for t in targets],
        "passthrough": pt,
        "gateway": gw,
        "added": added,
        "server_added_mean_s": server_added_s,
        "decisions": decisions,
        "degraded": degraded,
        "mirror_lookup_share": mirror_share,
        "other_rates": extra_data,
        "workers": args.workers,
        "cpu": cpu_data,
        "phases": phases,
    }
    stem = f"gateway-{started:%Y-%m-%d}" + (f"-workers{args.workers}" if args.workers > 1 else "")
    md_path, js_path = report.write(Path(args.out), stem, md, data)
    print(md)
    print(f"wrote {md_path} and {js_path}")
    return 0


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "gateway",
        help="latency added by kvdir gateway vs a pass-through proxy (same stack, same run)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rate", type=float, default=500.0, help="requests per second")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase")
    p.add_argument(
        "--extra-rates",
        type=float,
        nargs="*",
        default=[100.0, 250.0],
        help="also measure at these rates (informational)",
    )
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument(
        "--workers", type=int, default=1, help="processes per proxy on its port (SO_REUSEPORT)"
    )
    p.add_argument("--policy", default="affinity+pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="a line for the report (how the run was held)")
    p.add_argument("--out", default=str(report.REPO_ROOT / "bench" / "results"))
    p.set_defaults(func=run)
