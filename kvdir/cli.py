"""The `kvdir` command.

    kvdir directory serve   run one directory replica (a daemon)
    kvdir ctl status|nodes|lookup   inspect a running directory
    kvdir ctl add-replica|remove-replica|backup   membership and backups (kvdir/ops.py)
    kvdir ctl shards [split SHARD]   the shard map and each group (kvdir/ops_shards.py)
    kvdir directory restore|recover   a data dir from a backup, or from a lone survivor
    kvdir ctl wait-ready    block until replicas (or an agent) are ready; a systemd gate
    kvdir ctl check-hashes   the hashes a vLLM engine will publish, and a live check
    kvdir gateway           the OpenAI-compatible routing proxy (a daemon; docs/gateway.md)
    kvdir demo              a short cluster replay: real directory and agents, simulated GPUs
    kvdir bench directory   the directory benchmark
    kvdir bench replay      the seed's cluster experiment on a trace (docs/replay.md)
    kvdir fuzz              hostile input against real daemons; a report

Failures print one line, ``kvdir: error: ...``, and exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvdir import ops, ops_shards, secflags, tools
from kvdir.core.client import DirectoryClient, DirectoryError, namespace
from kvdir.core.config import ConfigError, read_toml
from kvdir.core.gc_freeze import freeze_startup
from kvdir.core.security import ClientSecurity, SecurityConfigError
from kvdir.core.sharded_client import AnyDirectoryClient, directory_client
from kvdir.directory.config import DirectoryConfig, from_dict, parse_peer
from kvdir.directory.consensus.tuning import RaftTuning
from kvdir.directory.limits import WatchLimits
from kvdir.harness import stopped_cleanly
from kvdir.v1 import directory_pb2 as pb

DEFAULT_ADDRS = "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103"
HARNESS_COMMANDS = ("demo", "bench", "fuzz")
"""Commands that start processes and wait on them (kvdir/harness.py); the rest are daemons
(their own SIGTERM handling) or one-shot clients."""


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


# ----------------------------------------------------------------- serve


def _serve_config(args: argparse.Namespace) -> DirectoryConfig:
    overrides: dict[str, Any] = {
        "replica_id": args.replica_id,
        "raft_address": args.raft,
        "grpc_address": args.grpc,
        "metrics_address": args.metrics,
        "data_dir": args.data_dir,
        "log_format": args.log_format,
        "enable_echo": True if args.enable_echo else None,
        "cluster_id": args.cluster_id,
        "join": True if args.join else None,
        "durability": args.durability,
        "group": args.group,
        "shard_home": [a for a in args.shard_home.split(",") if a] if args.shard_home else None,
        "shard_map_init": args.shard_map_init,
        "shard_refresh_ms": args.shard_refresh_ms,
    }
    peers = [parse_peer(p) for p in args.peer]
    tune = _tuning(args.tune)
    watch = _tuning(args.watch_limit, WatchLimits, "--watch-limit")
    if args.config:
        cfg = from_dict(secflags.apply_daemon_flags(read_toml(args.config, overrides), args))
        if tune:
            cfg = dataclasses.replace(cfg, raft=dataclasses.replace(cfg.raft, **tune))
        if watch:
            cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, **watch))
        if peers:
            raise ConfigError("give peers in the config file or as --peer flags, not both")
        return cfg
    raw = {k: v for k, v in overrides.items() if v is not None}
    raw["peers"] = [
        {"replica_id": p.replica_id, "raft_address": p.raft_address, "grpc_address": p.grpc_address}
        for p in peers
    ]
    if tune:
        raw["raft"] = tune
    if watch:
        raw["watch"] = watch
    return from_dict(secflags.apply_daemon_flags(raw, args))


def _tuning(specs: list[str], cls: Any = None, flag: str = "--tune") -> dict[str, Any]:
    """`--tune KEY=VALUE` flags as RaftTuning (or `cls`) overrides, typed like the field."""
    fields = {f.name: f for f in dataclasses.fields(cls or RaftTuning)}
    out: dict[str, Any] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or key not in fields:
            raise ConfigError(
                f"{flag} {spec!r}: expected one of {', '.join(sorted(fields))} as KEY=VALUE"
            )
        kind = int if fields[key].type in ("int", int) else float
        try:
            out[key] = kind(value)
        except ValueError as e:
            raise ConfigError(f"{flag} {spec!r}: {value!r} is not a {kind.__name__}") from e
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from kvdir.core import logs
    from kvdir.directory.consensus.journal import JournalCorrupt
    from kvdir.directory.consensus.votes import TermFileCorrupt
    from kvdir.directory.daemon import DirectoryDaemon, StartError

    cfg = _serve_config(args)
    logs.setup(cfg.log_format, args.log_level, {"replica_id": cfg.replica_id})
    daemon = DirectoryDaemon(cfg)
    try:
        daemon.start()
    except (StartError, JournalCorrupt, TermFileCorrupt) as e:
        raise CliError(str(e)) from e
    freeze_startup("directory")
    _until_signal()
    daemon.stop()
    return 0


SIGNAL_CHECK_S = 0.25
"""How often the main thread wakes to run a pending signal handler (see below)."""


def _until_signal() -> None:
    """Block until SIGTERM or SIGINT (systemd's stop, or ^C).

    The wait is bounded because Python runs signal handlers only in the main
    thread, between bytecodes: when the kernel delivers the signal to another
    thread (the CUDA driver's, in an agent with a GPU tier), a main thread
    blocked in an unbounded wait never runs the handler and the process
    ignores its stop (seen on the H200: the agent outlived SIGTERM).
    """
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(SIGNAL_CHECK_S):
        pass


# ----------------------------------------------------------------- agent


def _pool_spec(spec: str) -> dict[str, Any]:
    """`--pool model=M,block_tokens=16,slot_bytes=65536,slots=1024[,dtype=..]`."""
    out: dict[str, Any] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--pool {spec!r}: expected KEY=VALUE pairs")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def _engine_spec(spec: str) -> dict[str, Any]:
    """`--engine name=vllm0,endpoint=tcp://127.0.0.1:5557,model=M,block_tokens=16[,...]`."""
    out = _pool_spec(spec)
    for key in ("bind",):
        if key in out:
            out[key] = str(out[key]).lower() in ("1", "true", "yes")
    return out


def cmd_agent_serve(args: argparse.Namespace) -> int:
    from kvdir.agent import config as agent_config
    from kvdir.agent.daemon import AgentDaemon, AgentStartError
    from kvdir.core import logs

    overrides: dict[str, Any] = {
        "node_id": args.node_id,
        "host": args.host,
        "directory": args.directory,
        "listen": args.listen,
        "engine_socket": args.engine_socket,
        "metrics_address": args.metrics,
        "transports": args.transports,
        "lease_ms": args.lease_ms,
        "pool_dir": args.pool_dir,
        "log_format": args.log_format,
        "directory_mirror": args.directory_mirror,
        "directory_mirror_staleness_ms": args.directory_mirror_staleness_ms,
    }
    if args.pool:
        overrides["pools"] = [_pool_spec(p) for p in args.pool]
    if args.engine:
        overrides["engines"] = [_engine_spec(e) for e in args.engine]
    if args.config:
        raw = read_toml(args.config, overrides)
    else:
        raw = {k: v for k, v in overrides.items() if v is not None}
    cfg = agent_config.from_dict(secflags.apply_daemon_flags(raw, args))
    logs.setup(cfg.log_format, args.log_level, {"node_id": cfg.node_id})
    daemon = AgentDaemon(cfg)
    try:
        daemon.start()
    except AgentStartError as e:
        daemon.stop(deregister=False)
        raise CliError(str(e)) from e
    freeze_startup("agent")
    _until_signal()
    daemon.stop()
    return 0


# --------------------------------------------------------------- gateway


def cmd_gateway(args: argparse.Namespace) -> int:
    from kvdir.core import logs
    from kvdir.gateway import config as gateway_config
    from kvdir.gateway.server import serve
    from kvdir.gateway.workers import WorkerError, serve_workers

    overrides: dict[str, Any] = {
        "listen": args.listen,
        "directory": args.directory,
        "policy": args.policy,
        "log_format": args.log_format,
        "workers": args.workers,
    }
    cfg = gateway_config.load(args.config, overrides)
    logs.setup(cfg.log_format, args.log_level, {"component": "gateway"})
    try:
        if cfg.workers > 1:
            serve_workers(cfg, args.log_level)
        else:
            serve(cfg)
    except (OSError, WorkerError) as e:  # the listen address is taken, a worker died, ...
        raise CliError(f"gateway: {e}") from e
    return 0


# ------------------------------------------------------------------- ctl


def _client(args: argparse.Namespace) -> DirectoryClient:
    addrs = [a.strip() for a in args.addr.split(",") if a.strip()]
    return DirectoryClient(addrs, timeout_s=args.timeout, security=secflags.client_security(args))


def _reader(args: argparse.Namespace) -> AnyDirectoryClient:
    """`--sharded`: --addr is the shard home (g0), and reads go to every group by the
    map and are merged, as an agent's are; else one group, the replicas at --addr."""
    addrs = [a.strip() for a in args.addr.split(",") if a.strip()]
    security = secflags.client_security(args)
    return directory_client(addrs, addrs if args.sharded else [], args.timeout, security)


def _print(args: argparse.Namespace, obj: Any, text: Callable[[], str]) -> None:
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(obj, preserving_proto_field_name=True), indent=2))
    else:
        print(text())


_ROLES = {
    pb.ROLE_LEADER: "leader",
    pb.ROLE_FOLLOWER: "follower",
    pb.ROLE_CANDIDATE: "candidate",
    pb.ROLE_UNSPECIFIED: "?",
}


def format_status(statuses: Sequence[tuple[str, pb.ClusterStatusResponse | None, str]]) -> str:
    rows = [
        (
            "ADDRESS",
            "REPLICA",
            "ROLE",
            "TERM",
            "COMMIT",
            "APPLIED",
            "ENTRIES",
            "BLOCKS",
            "NODES",
            "LEADER",
        )
    ]
    for addr, s, err in statuses:
        if s is None:
            rows.append((addr, "-", f"unreachable: {err}", "", "", "", "", "", "", ""))
            continue
        rows.append(
            (
                addr,
                s.replica_id,
                _ROLES[s.role],
                str(s.term),
                str(s.commit_index),
                str(s.applied_index),
                str(s.entries),
                str(s.blocks),
                str(s.nodes),
                s.leader_id or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out: list[tuple[str, pb.ClusterStatusResponse | None, str]] = []
        for addr in c.addresses:
            try:
                out.append((addr, c.status(addr), ""))
            except DirectoryError as e:
                out.append((addr, None, e.code.name))
    if all(s is None for _, s, _ in out):
        raise CliError(f"no directory replica answered at {args.addr}")
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(
            json.dumps(
                {
                    a: (MessageToDict(s, preserving_proto_field_name=True) if s else {"error": e})
                    for a, s, e in out
                },
                indent=2,
            )
        )
    else:
        print(format_status(out))
        print()
        print(format_members(out))
    return 0


def format_members(statuses: Sequence[tuple[str, pb.ClusterStatusResponse | None, str]]) -> str:
    """The membership as the leader (else the first answering replica) sees it."""
    answered = [s for _, s, _ in statuses if s is not None]
    view = next((s for s in answered if s.role == pb.ROLE_LEADER), answered[0])
    lines = [
        f"MEMBERS ({len(view.members)}, as seen by {view.replica_id}"
        + (f", cluster {view.cluster_id}" if view.cluster_id else "")
        + ")"
    ]
    for m in view.members:
        state = "self" if m.is_self else ("connected" if m.connected else "NOT CONNECTED")
        lines.append(f"  {m.raft_address:24} {m.replica_id:24} {state}")
    return "\n".join(lines)


def _ready_once(
    addr: str, agent: bool, timeout_s: float, security: ClientSecurity
) -> tuple[bool, str]:
    """One probe: (ready, what it answered)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvdir.v1 import agent_pb2 as apb
    from kvdir.v1 import agent_pb2_grpc as apb_grpc

    target = addr if ":" in addr or addr.startswith("unix:") else f"unix:{addr}"
    with security.channel(target) as ch:
        try:
            if agent:
                h = apb_grpc.AgentStub(ch).Health(apb.AgentHealthRequest(), timeout=timeout_s)
                return h.directory_connected, f"directory_connected={h.directory_connected}"
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            return r.status == health_pb2.HealthCheckResponse.SERVING, name
        except grpc.RpcError as e:
            return False, e.code().name


def cmd_wait_ready(args: argparse.Namespace) -> int:
    """Block until every address is ready, or fail after --timeout (a systemd gate)."""
    import time

    if args.config:
        import tomllib

        try:
            with open(args.config, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise CliError(f"{args.config}: {e}") from e
        key = "listen" if args.agent else "grpc_address"
        if not isinstance(raw.get(key), str):
            raise CliError(f"{args.config}: no {key} to probe")
        args.addr = raw[key]
    addrs = [a.strip() for a in args.addr.split(",") if a.strip()]
    security = secflags.client_security(args)
    deadline = time.monotonic() + args.timeout
    last: dict[str, str] = {}
    pending = list(addrs)
    while pending:
        for a in list(pending):
            probe_s = max(0.1, min(1.0, deadline - time.monotonic()))
            ok, last[a] = _ready_once(a, args.agent, probe_s, security)
            if ok:
                pending.remove(a)
        if not pending:
            break
        if time.monotonic() >= deadline:
            detail = ", ".join(f"{a}: {last[a]}" for a in pending)
            raise CliError(f"not ready after {args.timeout:.0f}s ({detail})")
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
    print(f"ready: {', '.join(addrs)}")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with _reader(args) as c:
        resp = c.list_nodes()

    def text() -> str:
        lines = [f"{'NODE':24} {'HOST':16} {'INCARNATION':>20} {'ENTRIES':>9}  TRANSPORTS"]
        for n in resp.nodes:
            lines.append(
                f"{n.node_id:24} {n.host:16} {n.incarnation:>20} {n.entries:>9}  "
                f"{','.join(n.transports)}"
            )
        return "\n".join(lines)

    _print(args, resp, text)
    return 0


def _chain(args: argparse.Namespace) -> list[bytes]:
    try:
        if args.hashes:
            return [bytes.fromhex(h) for h in args.hashes.split(",")]
        if args.ids:
            return [int(i).to_bytes(8, "big") for i in args.ids.split(",")]
    except ValueError as e:
        raise CliError(f"bad block hash list: {e}") from e
    raise CliError("give --hashes HEX,HEX,... or --ids N,N,...")


def cmd_lookup(args: argparse.Namespace) -> int:
    ns = namespace(
        args.model, args.block_tokens, args.dtype, args.layout, args.tp_rank, args.tp_size
    )
    with _reader(args) as c:
        resp = c.lookup(
            ns,
            _chain(args),
            max_nodes=args.max_nodes,
            exclude_node=args.exclude,
            linearizable=args.linearizable,
        )

    def text() -> str:
        r = resp.read
        lines = [
            f"read from {r.replica_id} ({_ROLES[r.role]}) at applied index "
            f"{r.applied_index}{', linearizable' if r.linearizable else ''}"
        ]
        if not resp.matches:
            lines.append("no node holds a prefix of this chain")
        for m in resp.matches:
            lines.append(
                f"{m.node_id}: {m.prefix_blocks} blocks via {m.agent_endpoint or '-'} "
                f"({','.join(m.transports) or 'index only'})"
            )
        return "\n".join(lines)

    _print(args, resp, text)
    return 0


# ---------------------------------------------------------- check-hashes


def _int_list(spec: str) -> list[int]:
    """`1,2,3` or `START:STOP` (a range)."""
    if ":" in spec:
        lo, _, hi = spec.partition(":")
        return list(range(int(lo), int(hi)))
    return [int(t) for t in spec.split(",") if t.strip()]


def _watch_engine(args: argparse.Namespace) -> Any:
    """The first checkable BlockStored the engine at --endpoint publishes."""
    import time

    import zmq

    from kvdir.agent.events.decode import BlockStored, DecodeError, decode_batch
    from kvdir.agent.events.selfcheck import checkable

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    (sock.bind if args.bind else sock.connect)(args.endpoint)
    deadline = time.monotonic() + args.timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000)):
                break
            frames = sock.recv_multipart()
            if len(frames) != 3:
                continue
            try:
                batch = decode_batch(frames[2])
            except DecodeError:
                continue
            for ev in batch.events:
                if type(ev) is BlockStored and checkable(ev):
                    return ev
    finally:
        sock.close(0)
    raise CliError(
        f"no checkable BlockStored event from {args.endpoint} within {args.timeout:.0f}s "
        "(send the engine a prompt of at least one full block)"
    )


def cmd_check_hashes(args: argparse.Namespace) -> int:
    """Recompute the block hashes vLLM publishes; compare with given or live ones."""
    from kvdir.agent.events.decode import BlockStored
    from kvdir.agent.events.selfcheck import SelfCheckError, check_event, first_block_hashes

    try:
        if args.endpoint:
            ev = _watch_engine(args)
        else:
            if not args.tokens:
                raise CliError("give --tokens (and --expect) or --endpoint")
            toks = _int_list(args.tokens)
            hashes = first_block_hashes(toks, args.block_size, args.algo, args.seed, not args.bytes)
            if not args.expect:
                for h in hashes:
                    print(h.hex() if isinstance(h, bytes) else h)
                return 0
            exp = [t.strip() for t in args.expect.split(",") if t.strip()]
            got: list[int | bytes] = [int(t) if t.isdigit() else bytes.fromhex(t) for t in exp]
            ev = BlockStored(got, None, toks, args.block_size)
        result = check_event(ev, args.algo, args.seed, args.block_size)
    except SelfCheckError as e:
        raise CliError(str(e)) from e
    if result is None:
        raise CliError("the event cannot be checked (an int parent hash or extra keys)")
    print(
        ("ok: " if result.ok else "") + result.message, file=sys.stdout if result.ok else sys.stderr
    )
    return 0 if result.ok else 1


# ----------------------------------------------------------------- chaos


def cmd_chaos(args: argparse.Namespace) -> int:
    chaos = tools.load("bench.chaos.run", "chaos")

    kinds = tuple(k for k in args.kinds.split(",") if k) or chaos.FAULT_KINDS
    cfg = chaos.ChaosConfig(
        out=args.out,
        replicas=args.replicas,
        faults=args.faults,
        seed=args.seed,
        agents=args.agents,
        keys=args.keys,
        pace_ms=args.pace_ms,
        kinds=kinds,
        max_seconds=args.max_seconds,
    )
    try:
        result = chaos.run(cfg, stream=sys.stdout)
    except (ValueError, RuntimeError) as e:
        raise CliError(str(e)) from e
    f = result.report.figures
    print(
        f"faults {f['faults']}, operations {f['operations']}, acknowledged {f['acknowledged']}, "
        f"lost {f['lost']}, linearizability violations {f['linearizability_violations']}; "
        f"report {result.paths['markdown']}"
    )
    for v in result.report.violations:
        print(f"violation: {v}", file=sys.stderr)
    return 0 if not result.report.violations else 1


# ---------------------------------------------------------------- parser


def build_parser(with_benchmarks: bool = True) -> argparse.ArgumentParser:
    """The whole command tree; benchmark modules (heavy imports) only when asked."""
    p = argparse.ArgumentParser(prog="kvdir", description="Cluster-wide KV-cache pool.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("directory", help="the directory service").add_subparsers(
        dest="directory_command", required=True
    )
    s = d.add_parser("serve", help="run one directory replica")
    s.add_argument("--config", help="TOML config file (flags override it)")
    s.add_argument("--replica-id")
    s.add_argument("--raft", help="this replica's Raft HOST:PORT")
    s.add_argument("--grpc", help="gRPC HOST:PORT to serve on")
    s.add_argument("--metrics", help="Prometheus HOST:PORT (empty: off)")
    s.add_argument("--data-dir", help="journal and snapshot directory")
    s.add_argument(
        "--peer",
        action="append",
        default=[],
        help="ID=RAFT_HOST:PORT,GRPC_HOST:PORT (repeat per peer)",
    )
    s.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a Raft tuning field (directory.consensus.tuning.RaftTuning)",
    )
    s.add_argument(
        "--watch-limit",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a Watch stream bound (directory.limits.WatchLimits)",
    )
    s.add_argument(
        "--enable-echo",
        action="store_true",
        help="also serve the Echo baseline used by `kvdir bench directory`",
    )
    s.add_argument(
        "--cluster-id", help="join a restored cluster with an empty data dir (operations.md)"
    )
    s.add_argument(
        "--join",
        action="store_true",
        help="first start of a replica being added: never campaign before a leader is heard",
    )
    s.add_argument(
        "--durability",
        choices=["power-loss", "process-crash"],
        help="power-loss (default): fsync the Raft log before acknowledging; process-crash: "
        "faster, but a power loss of a majority can lose ~1 s of acknowledged writes",
    )
    s.add_argument("--group", help='this replica\'s shard group (default "g0"; docs/sharding.md)')
    s.add_argument(
        "--shard-home",
        help="comma-separated gRPC addresses of the home group g0 (absent: unsharded)",
    )
    s.add_argument(
        "--shard-map-init",
        metavar="FILE",
        help="group g0: a JSON shard map committed as version 1 when none is committed yet",
    )
    s.add_argument(
        "--shard-refresh-ms", type=int, help="how often to ask g0 for a newer map (1000)"
    )
    s.add_argument("--log-format", choices=["json", "text"])
    s.add_argument("--log-level", default="INFO")
    secflags.add_daemon_flags(s, directory=True)
    s.set_defaults(func=cmd_serve)
    ops.add_directory_parsers(d)

    ag = sub.add_parser("agent", help="the node agent").add_subparsers(
        dest="agent_command", required=True
    )
    a = ag.add_parser("serve", help="run the node agent")
    a.add_argument("--config", help="TOML config file (flags override it)")
    a.add_argument("--node-id")
    a.add_argument("--host", help="the address peers reach this node on")
    a.add_argument("--directory", help="comma-separated directory gRPC addresses")
    a.add_argument("--listen", help="HOST:PORT for the peer-facing kvdir.v1.Agent service")
    a.add_argument("--engine-socket", help="Unix socket for the engine-facing service")
    a.add_argument("--metrics", help="Prometheus HOST:PORT (empty: off)")
    a.add_argument("--transports", help="comma-separated backends to offer (tcp,shm)")
    a.add_argument("--lease-ms", type=int)
    a.add_argument(
        "--directory-mirror",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lookups from an in-process mirror of the directory (default on; docs/agent.md)",
    )
    a.add_argument("--directory-mirror-staleness-ms", type=int)
    a.add_argument("--pool-dir", help="where the pool files live (default /dev/shm)")
    a.add_argument(
        "--pool",
        action="append",
        default=[],
        help="model=M,block_tokens=N,slot_bytes=B,slots=S[,dtype=..,layout=..]",
    )
    a.add_argument(
        "--engine",
        action="append",
        default=[],
        help="ingest a stock engine's KV events: name=N,endpoint=E,model=M,block_tokens=B"
        "[,replay_endpoint=..,dp_size=..,hash_algo=..,bind=true] (docs/events.md)",
    )
    a.add_argument("--log-format", choices=["json", "text"])
    a.add_argument("--log-level", default="INFO")
    secflags.add_daemon_flags(a, directory=False)
    a.set_defaults(func=cmd_agent_serve)

    ctl = sub.add_parser("ctl", help="inspect a running directory").add_subparsers(
        dest="ctl_command", required=True
    )
    for name, func, helptext in (
        ("status", cmd_status, "each replica's Raft and table state"),
        ("nodes", cmd_nodes, "registered holder nodes"),
        ("lookup", cmd_lookup, "who holds a prefix of a chain"),
    ):
        c = ctl.add_parser(name, help=helptext)
        c.add_argument(
            "--addr", default=DEFAULT_ADDRS, help="comma-separated replica gRPC addresses"
        )
        c.add_argument("--timeout", type=float, default=5.0)
        c.add_argument("--json", action="store_true")
        secflags.add_client_flags(c)
        c.set_defaults(func=func)
        if name != "status":  # status is per replica: `ctl shards` shows every group's
            c.add_argument(
                "--sharded",
                action="store_true",
                help="--addr is the shard home (group g0): ask every group by the shard "
                "map and merge the answers (docs/sharding.md)",
            )
        if name == "lookup":
            c.add_argument("--model", required=True)
            c.add_argument("--block-tokens", type=int, required=True)
            c.add_argument("--dtype", default="")
            c.add_argument("--layout", default="")
            c.add_argument("--tp-rank", type=int, default=0)
            c.add_argument("--tp-size", type=int, default=0)
            c.add_argument("--hashes", help="comma-separated hex block hashes")
            c.add_argument("--ids", help="comma-separated unsigned 64-bit block ids")
            c.add_argument("--max-nodes", type=int, default=0)
            c.add_argument("--exclude", default="")
            c.add_argument("--linearizable", action="store_true")

    ops.add_ctl_parsers(ctl, DEFAULT_ADDRS)
    ops_shards.add_ctl_parsers(ctl, DEFAULT_ADDRS)
    w = ctl.add_parser(
        "wait-ready",
        help="wait until replicas report SERVING (or an agent is connected), bounded",
    )
    w.add_argument("--addr", default=DEFAULT_ADDRS, help="comma-separated gRPC addresses")
    w.add_argument(
        "--config", help="probe the address in this directory (or, with --agent, agent) TOML"
    )
    w.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    w.add_argument("--interval", type=float, default=0.5, help="seconds between probes")
    w.add_argument(
        "--agent",
        action="store_true",
        help="probe kvdir.v1.Agent.Health (ready: connected to the directory)",
    )
    secflags.add_client_flags(w)
    w.set_defaults(func=cmd_wait_ready)
    ch = ctl.add_parser(
        "check-hashes",
        help="recompute the block hashes vLLM publishes; compare with an engine's",
    )
    ch.add_argument("--block-size", type=int, default=16)
    ch.add_argument("--algo", default="sha256", help="the engine's --prefix-caching-hash-algo")
    ch.add_argument("--seed", default="", help="the engine's PYTHONHASHSEED (empty: vLLM default)")
    ch.add_argument("--tokens", help="token ids: 1,2,3 or START:STOP")
    ch.add_argument("--bytes", action="store_true", help="32-byte hashes (INT_BLOCK_HASHES=0)")
    ch.add_argument("--expect", help="the hashes the engine published (ints or hex), in order")
    ch.add_argument("--endpoint", help="check the engine's live events at this ZMQ endpoint")
    ch.add_argument("--bind", action="store_true", help="bind --endpoint (engine connects)")
    ch.add_argument("--timeout", type=float, default=30.0)
    ch.set_defaults(func=cmd_check_hashes)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible routing proxy (docs/gateway.md)")
    gw.add_argument("--config", required=True, help="TOML config file (flags override it)")
    gw.add_argument("--listen", help="HOST:PORT to serve HTTP(S) on")
    gw.add_argument("--directory", help="comma-separated directory gRPC addresses")
    gw.add_argument(
        "--policy", help="random | round-robin | least-loaded | affinity | affinity+pool"
    )
    gw.add_argument("--log-format", choices=["json", "text"])
    gw.add_argument("--workers", type=int, help="processes sharing the listen port (SO_REUSEPORT)")
    gw.add_argument("--log-level", default="INFO")
    gw.set_defaults(func=cmd_gateway)

    from kvdir import demo

    demo.add_parser(sub)
    _add_tool_parsers(sub, with_benchmarks)
    return p


def _tool_absent(what: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        tools.load("bench", what)  # raises ToolsMissing with the one-line reason
        return 1

    return run


def _add_tool_parsers(sub: Any, with_benchmarks: bool) -> None:
    """`kvdir fuzz|sim|chaos|bench`: the checkout's tools (bench/), or one line saying why not."""
    if not tools.available():
        for what in ("fuzz", "sim", "chaos", "bench"):
            sub.add_parser(what, help=f"{what} (needs a source checkout)").set_defaults(
                func=_tool_absent(what)
            )
        return
    tools.load("bench.fuzz", "fuzz").add_parser(sub)
    tools.load("bench.sim", "sim").add_parser(sub)
    cs = sub.add_parser(
        "chaos", help="faults on a schedule against a namespaced directory; check the history"
    )
    cs.add_argument("--replicas", type=int, default=3, choices=[3, 5])
    cs.add_argument("--faults", type=int, default=20)
    cs.add_argument("--out", required=True, help="directory for histories, logs and the report")
    cs.add_argument("--seed", type=int, default=1)
    cs.add_argument("--agents", type=int, default=4, help="publishing agents (4 x --keys keys)")
    cs.add_argument("--keys", type=int, default=16, help="blocks per agent")
    cs.add_argument("--pace-ms", type=float, default=20.0, help="pause between one client's ops")
    cs.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
    cs.add_argument("--max-seconds", type=float, default=1800.0, help="stop injecting after this")
    cs.set_defaults(func=cmd_chaos)
    if with_benchmarks:
        tools.load("bench", "bench").add_parsers(sub)
    else:
        sub.add_parser("bench", help="benchmarks (results go under bench/results/)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Daemons never import the benchmark modules: a faster start, and nothing a
    # benchmark imports can keep `kvdir directory serve` from starting.
    parser = build_parser(with_benchmarks=bool(argv) and argv[0] == "bench")
    args = parser.parse_args(argv)
    # Harnesses (they start replicas, agents, engines) end all of it on SIGTERM as on ^C.
    harness = bool(argv) and argv[0] in HARNESS_COMMANDS
    try:
        with stopped_cleanly() if harness else contextlib.nullcontext():
            rc: int = args.func(args)
        return rc
    except (
        CliError,
        ConfigError,
        DirectoryError,
        ops.OpsError,
        SecurityConfigError,
        tools.ToolsMissing,
    ) as e:
        print(f"kvdir: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
