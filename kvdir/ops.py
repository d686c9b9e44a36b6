"""Operator commands: membership, backup, restore, recovery (docs/operations.md).

kvdir ctl add-replica RAFT_ADDR      propose a new member (on the leader)
kvdir ctl remove-replica RAFT_ADDR   propose removing a member
kvdir ctl backup --out FILE          a consistent backup streamed from a replica
kvdir directory restore FILE --data-dir D [--members ...]
kvdir directory recover --data-dir D --new-members ... --out FILE
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import grpc

from kvdir import secflags
from kvdir.directory import backup
from kvdir.directory.consensus.membership import MembershipError
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

BACKUP_BYTES_MAX = 8 << 30
"""A sanity bound on what `ctl backup` accepts (1M entries are ~100 MB)."""


class OpsError(Exception):
    """Printed as one line by the CLI."""


def _addrs(spec: str) -> list[str]:
    return [a.strip() for a in spec.split(",") if a.strip()]


def _trailer(e: grpc.RpcError, key: str) -> str:
    for item in e.trailing_metadata() or ():
        if item.key == key:
            v = item.value
            return v.decode() if isinstance(v, bytes) else str(v)
    return ""


def _membership(args: argparse.Namespace, method: str, request: Any) -> pb.MembershipResponse:
    """Call `method` on the leader: follow `kvdir-leader` hints, try each address, bounded."""
    addrs = _addrs(args.addr)
    if not addrs:
        raise OpsError("give --addr HOST:PORT,... (replica gRPC addresses)")
    deadline = time.monotonic() + args.timeout
    target, last = addrs[0], "no replica answered"
    tried = 0
    while time.monotonic() < deadline and tried < 64:
        tried += 1
        left = max(0.1, deadline - time.monotonic())
        with secflags.client_security(args).channel(target) as ch:
            try:
                resp: pb.MembershipResponse = getattr(pb_grpc.DirectoryAdminStub(ch), method)(
                    request, timeout=left
                )
                return resp
            except grpc.RpcError as e:
                code, detail = e.code(), e.details() or e.code().name
                last = f"{target}: {detail}"
                hint = _trailer(e, "kvdir-leader")
                if code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.ALREADY_EXISTS,
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.ABORTED,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.UNIMPLEMENTED,
                ):
                    raise OpsError(last) from e
                if code == grpc.StatusCode.FAILED_PRECONDITION and "quorum" in detail:
                    raise OpsError(last) from e
        if hint and hint != target:
            target = hint
            continue
        target = addrs[(addrs.index(target) + 1) % len(addrs)] if target in addrs else addrs[0]
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise OpsError(f"no leader took the change within {args.timeout:.0f}s ({last})")


def _print_members(resp: pb.MembershipResponse) -> None:
    print(f"members (applied index {resp.applied_index}):")
    for m in resp.members:
        state = "self" if m.is_self else ("connected" if m.connected else "not connected")
        name = m.replica_id if m.replica_id != m.raft_address else "-"
        print(f"  {m.raft_address:24} {name:12} {state}")


def cmd_add_replica(args: argparse.Namespace) -> int:
    req = pb.AddReplicaRequest(
        raft_address=args.raft_address, replica_id=args.id or "", grpc_address=args.grpc or ""
    )
    resp = _membership(args, "AddReplica", req)
    print(f"added {args.raft_address}; now start it with every member as a peer")
    _print_members(resp)
    return 0


def cmd_remove_replica(args: argparse.Namespace) -> int:
    resp = _membership(
        args, "RemoveReplica", pb.RemoveReplicaRequest(raft_address=args.raft_address)
    )
    print(f"removed {args.raft_address}; stop it and wipe its data dir")
    _print_members(resp)
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    """Stream a backup from the first replica that gives one; verify it; then rename it."""
    errors = []
    for addr in _addrs(args.addr):
        tmp = f"{args.out}.partial-{os.getpid()}"
        try:
            with secflags.client_security(args).channel(addr) as ch, open(tmp, "wb") as f:
                got = 0
                for chunk in pb_grpc.DirectoryAdminStub(ch).Backup(
                    pb.BackupRequest(skip_barrier=args.skip_barrier), timeout=args.timeout
                ):
                    got += len(chunk.data)
                    if got > BACKUP_BYTES_MAX:
                        raise OpsError(f"{addr}: backup over {BACKUP_BYTES_MAX} bytes")
                    f.write(chunk.data)
                f.flush()
                os.fsync(f.fileno())
            header, _ = backup.load_backup(tmp)
            os.replace(tmp, args.out)
        except grpc.RpcError as e:
            errors.append(f"{addr}: {e.details() or e.code().name}")
            continue
        except backup.BackupError as e:
            errors.append(f"{addr}: {e}")
            continue
        except OSError as e:
            raise OpsError(f"cannot write {args.out}: {e.strerror}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        print(
            f"backup of {header.source_replica} at index {header.index} (term {header.term}): "
            f"{header.entries} entries, {header.snapshot_bytes} bytes, sha256 {header.sha256} "
            f"-> {args.out}"
        )
        return 0
    raise OpsError("no replica gave a backup (" + "; ".join(errors) + ")")


def cmd_restore(args: argparse.Namespace) -> int:
    members = _addrs(args.members) if args.members else None
    try:
        out = backup.restore(args.file, args.data_dir, members, args.cluster_id or "")
    except (backup.BackupError, MembershipError) as e:
        raise OpsError(str(e)) from e
    print(
        f"restored {out.entries} entries into {args.data_dir}: cluster {out.cluster_id}, "
        f"members {','.join(out.members)}, index {out.index}"
    )
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    if os.path.exists(args.out):
        raise OpsError(f"{args.out} exists; choose a new --out")
    try:
        header, state, aside, out = backup.recover_in_place(
            args.data_dir, _addrs(args.new_members), args.out, args.replica_id or ""
        )
    except (backup.BackupError, MembershipError) as e:
        raise OpsError(str(e)) from e
    except OSError as e:
        raise OpsError(f"{args.data_dir}: {e.strerror}") from e
    print(
        f"recovered {state.table.entries} entries from {args.data_dir}: snapshot at index "
        f"{state.snapshot_index}, {state.replayed} log entries replayed (last index "
        f"{state.index}, commit index recorded {state.commit_index})\n"
        f"old files kept in {aside}\n"
        f"new cluster {out.cluster_id} with members {','.join(out.members)}; {args.data_dir} "
        f"is ready.\nfor every other new member, on an empty data dir:\n"
        f"  kvdir directory restore {args.out} --data-dir DATA_DIR\n"
        f"then start every member with the new members as peers (sha256 {header.sha256})"
    )
    return 0


def add_ctl_parsers(ctl: Any, default_addrs: str) -> None:
    for name, func, helptext in (
        ("add-replica", cmd_add_replica, "add a member (run on the leader, found for you)"),
        ("remove-replica", cmd_remove_replica, "remove a member"),
    ):
        c = ctl.add_parser(name, help=helptext)
        c.add_argument("raft_address", help="the member's Raft HOST:PORT")
        c.add_argument("--addr", default=default_addrs, help="replica gRPC addresses")
        c.add_argument("--timeout", type=float, default=15.0)
        c.set_defaults(func=func)
        secflags.add_client_flags(c)
        if name == "add-replica":
            c.add_argument("--id", help="its replica id (shown by every member)")
            c.add_argument("--grpc", help="its gRPC HOST:PORT (leader hints to clients)")
    b = ctl.add_parser("backup", help="a consistent backup file from a running replica")
    b.add_argument("--out", required=True, help="the backup file to write")
    b.add_argument("--addr", default=default_addrs, help="replicas to try, in order")
    b.add_argument("--timeout", type=float, default=120.0)
    b.add_argument(
        "--skip-barrier",
        action="store_true",
        help="no Raft barrier first: what the replica applied (works without a quorum)",
    )
    b.set_defaults(func=cmd_backup)
    secflags.add_client_flags(b)


def add_directory_parsers(d: Any) -> None:
    r = d.add_parser("restore", help="prepare an empty data dir from a backup file")
    r.add_argument("file")
    r.add_argument("--data-dir", required=True)
    r.add_argument("--members", help="RAFT_HOST:PORT,... of the new cluster (default: backup's)")
    r.add_argument("--cluster-id", help="default: derived from the file (same on every member)")
    r.set_defaults(func=cmd_restore)
    v = d.add_parser(
        "recover", help="rebuild a cluster from one stopped survivor's data dir (majority lost)"
    )
    v.add_argument("--data-dir", required=True, help="the survivor's data dir (replica stopped)")
    v.add_argument("--new-members", required=True, help="RAFT_HOST:PORT,... of the new cluster")
    v.add_argument("--out", required=True, help="the recovery file to write (for the others)")
    v.add_argument("--replica-id", help="the survivor's id (recorded in the file)")
    v.set_defaults(func=cmd_recover)
