"""`kvdir ctl shards`: the shard map and each group's state; `split` changes it.

kvdir ctl shards --addr G0_ADDRS              the map, then per group its leader,
                                              term, commit/applied indexes, entries
kvdir ctl shards split SHARD --addr G0_ADDRS  split SHARD in the middle (or --at KEY):
                                              a map change only, both halves stay put
kvdir ctl shards move SHARD --to GROUP ...    move SHARD's entries to GROUP and the map
                                              with them (kvdir/shard_move.py)

`--addr` names the home group's (g0's) replicas: the map lives in its log. The
split is a compare-and-set against the version read just before, so two
operators' changes never overwrite each other (the loser is told to retry).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import grpc

from kvdir import secflags
from kvdir.core import shard_wire
from kvdir.core.security import ClientSecurity
from kvdir.core.shard_map import KEY_SPACE, ShardMap, ShardMapError
from kvdir.ops import OpsError, _addrs, _trailer
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

STATUS_TIMEOUT_S = 2.0
"""Each replica's ClusterStatus: a down replica costs at most this."""


def fetch_map(addrs: list[str], security: ClientSecurity, timeout_s: float) -> ShardMap:
    """The map the first home replica gives (GetShardMap), or OpsError naming why not."""
    errors = []
    deadline = time.monotonic() + timeout_s
    for addr in addrs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with security.channel(addr) as ch:
            try:
                resp = pb_grpc.PrefixDirectoryStub(ch).GetShardMap(
                    pb.GetShardMapRequest(), timeout=left
                )
            except grpc.RpcError as e:
                errors.append(f"{addr}: {e.details() or e.code().name}")
                continue
        if not resp.HasField("map"):
            raise OpsError(f"{addr} is unsharded (started without --shard-home): no shard map")
        try:
            return shard_wire.from_pb(resp.map)
        except ShardMapError as e:
            raise OpsError(f"{addr} sent a map that is not valid: {e}") from e
    raise OpsError("no replica gave the shard map (" + "; ".join(errors or ["timed out"]) + ")")


def _status(security: ClientSecurity, addr: str) -> pb.ClusterStatusResponse | str:
    with security.channel(addr) as ch:
        try:
            resp: pb.ClusterStatusResponse = pb_grpc.PrefixDirectoryStub(ch).ClusterStatus(
                pb.ClusterStatusRequest(), timeout=STATUS_TIMEOUT_S
            )
            return resp
        except grpc.RpcError as e:
            return e.details() or e.code().name


def _span(lo: int, hi: int) -> str:
    return f"{lo:#018x}..{hi - 1:#018x} ({(hi - lo) / KEY_SPACE:.1%})"


def format_map(m: ShardMap) -> list[str]:
    lines = [f"shard map v{m.version}: {len(m.shards)} shards, {len(m.groups)} groups"]
    for s in m.shards:
        move = f" -> {s.target_group}" if s.target_group else ""
        lines.append(f"  shard {s.shard_id:<5} {_span(s.lo, s.hi)}  {s.group_id} {s.state}{move}")
    return lines


def format_group(
    group_id: str, statuses: list[tuple[str, pb.ClusterStatusResponse | str]]
) -> list[str]:
    lines = [f"group {group_id}:"]
    for addr, st in statuses:
        if isinstance(st, str):
            lines.append(f"  {addr:22} down: {st}")
            continue
        role = pb.Role.Name(st.role).removeprefix("ROLE_").lower()
        lines.append(
            f"  {addr:22} {st.replica_id:6} {role:9} leader {st.leader_id or '-':6} "
            f"term {st.term:<4} commit {st.commit_index:<8} applied {st.applied_index:<8} "
            f"entries {st.entries:<9} map v{st.shard_map_version}"
        )
    return lines


def cmd_shards(args: argparse.Namespace) -> int:
    security = secflags.client_security(args)
    addrs = _addrs(args.addr)
    if not addrs:
        raise OpsError("give --addr HOST:PORT,... (the home group's gRPC addresses)")
    if args.action == "split":
        return _split(args, security, addrs)
    if args.action == "move":
        return _move(args, security, addrs)
    if args.action is not None or args.shard is not None:
        raise OpsError("usage: kvdir ctl shards [split SHARD | move SHARD --to GROUP]")
    m = fetch_map(addrs, security, args.timeout)
    groups = {g.group_id: [(a, _status(security, a)) for a in g.replicas] for g in m.groups}
    if args.json:
        print(json.dumps({"map": json.loads(m.to_json()), "groups": _json_groups(groups)}))
        return 0
    lines = format_map(m)
    for gid, statuses in groups.items():
        lines += format_group(gid, statuses)
    print("\n".join(lines))
    return 0


def _json_groups(
    groups: dict[str, list[tuple[str, pb.ClusterStatusResponse | str]]],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gid, statuses in groups.items():
        out[gid] = [
            {"address": a, "error": st}
            if isinstance(st, str)
            else {
                "address": a,
                "replica_id": st.replica_id,
                "role": pb.Role.Name(st.role),
                "leader_id": st.leader_id,
                "term": st.term,
                "commit_index": st.commit_index,
                "applied_index": st.applied_index,
                "entries": st.entries,
                "shard_map_version": st.shard_map_version,
            }
            for a, st in statuses
        ]
    return out


def _split(args: argparse.Namespace, security: ClientSecurity, addrs: list[str]) -> int:
    if args.shard is None:
        raise OpsError("name the shard to split: kvdir ctl shards split SHARD")
    m = fetch_map(addrs, security, args.timeout)
    new_id = max(s.shard_id for s in m.shards) + 1
    try:
        new = m.with_split(args.shard, new_id, args.at)
    except ShardMapError as e:
        raise OpsError(str(e)) from e
    req = pb.SetShardMapRequest(expected_version=m.version, map=shard_wire.to_pb(new))
    committed = _set_map(addrs, security, req, args.timeout)
    print(f"split shard {args.shard}: the upper half is shard {new_id}")
    print("\n".join(format_map(committed)))
    return 0


def _move(args: argparse.Namespace, security: ClientSecurity, addrs: list[str]) -> int:
    from kvdir import shard_move  # the directory's codec and snapshot: only for a move

    if args.shard is None or not args.to:
        raise OpsError("name the shard and its new group: kvdir ctl shards move SHARD --to GROUP")
    done = shard_move.move(
        tuple(addrs),
        security,
        lambda: fetch_map(addrs, security, args.timeout),
        args.shard,
        args.to,
        args.timeout,
        lambda line: print(line, flush=True),
    )
    print(f"moved shard {args.shard} to group {args.to}")
    print("\n".join(format_map(done)))
    return 0


def _set_map(
    addrs: list[str], security: ClientSecurity, req: pb.SetShardMapRequest, timeout_s: float
) -> ShardMap:
    """SetShardMap through the first home replica that takes it (UNAVAILABLE: the next)."""
    deadline = time.monotonic() + timeout_s
    last = "timed out"
    for addr in addrs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with security.channel(addr) as ch:
            try:
                resp = pb_grpc.DirectoryAdminStub(ch).SetShardMap(req, timeout=left)
                return shard_wire.from_pb(resp.map)
            except grpc.RpcError as e:
                last = f"{addr}: {e.details() or e.code().name}"
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    reason = _trailer(e, "kvdir-reason")
                    hint = "; read the map again and retry" if reason == "stale_version" else ""
                    raise OpsError(last + hint) from e
    raise OpsError(f"no home replica committed the change ({last})")


def add_ctl_parsers(ctl: Any, default_addrs: str) -> None:
    s = ctl.add_parser(
        "shards", help="the shard map and each group's state; `split SHARD` splits a shard"
    )
    s.add_argument(
        "action", nargs="?", choices=["split", "move"], help="split SHARD, or move SHARD --to"
    )
    s.add_argument("shard", nargs="?", type=int, help="the shard to split or move")
    s.add_argument("--at", type=int, help="split at this key (default: the shard's middle)")
    s.add_argument("--to", help="move: the group to move the shard to")
    s.add_argument("--addr", default=default_addrs, help="the home group's (g0) gRPC addresses")
    s.add_argument("--timeout", type=float, default=10.0, help="seconds (a move: give more)")
    s.add_argument("--json", action="store_true")
    secflags.add_client_flags(s)
    s.set_defaults(func=cmd_shards)
