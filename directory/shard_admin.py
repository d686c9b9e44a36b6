"""SetShardMap: an operator's change of the shard map, committed in the home
group's log as a compare-and-set (docs/sharding.md).

The checks here give a readable status early; the state machine
(`Table._set_shard_map`) checks the version and the handover again at apply
time, in log order, which is what makes two racing changes safe.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from kvdir.core import shard_wire
from kvdir.core.shard_map import KEY_SPACE, ShardMapError
from kvdir.directory import codec
from kvdir.directory.block_index import SHARDS
from kvdir.directory.commands import (
    BeginImport,
    ClearNode,
    Command,
    DropShard,
    ExpireNodes,
    FreezeShard,
    Import,
    ImportDone,
    Publish,
    Published,
    Reject,
    Rejected,
    Remove,
    Removed,
    Result,
    SetShardMap,
    ShardMapSet,
)
from kvdir.directory.consensus.port import Consensus, Outcome
from kvdir.directory.limits import COMMAND_BYTES_MAX, SHARD_MAP_BYTES_MAX
from kvdir.directory.shard_view import HOME_GROUP, ShardView
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.directory.shards")

WRITE_TIMEOUT_S = 10.0
IMPORT_COMMANDS_MAX = 256
"""Commands one ImportShard call may carry (each is one Raft write, in order)."""
IMPORT_HEAD_BYTES = 16
"""What an Import adds around the command it carries (codec: header, shard id, length)."""


def _abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    reason: str,
    message: str,
    version: int | None = None,
) -> NoReturn:
    trailers = [("kvdir-reason", reason)]
    if version is not None:
        trailers.append((shard_wire.SHARD_MAP_VERSION_KEY, str(version)))
    context.set_trailing_metadata(tuple(trailers))
    context.abort(code, message)


def set_shard_map(
    view: ShardView,
    consensus: Consensus,
    request: pb.SetShardMapRequest,
    context: grpc.ServicerContext,
) -> pb.SetShardMapResponse:
    if not view.home:
        where = f"group {view.group_id!r}" if view.sharded else "an unsharded replica"
        _abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            shard_wire.REASON_NOT_HOME,
            f"this is {where}: the shard map lives in the home group {HOME_GROUP!r} "
            "(a sharded replica started with --group g0)",
        )
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not request.HasField("map"):
        _abort(context, bad, shard_wire.REASON_BAD_SHARD_MAP, "no map given")
    try:
        new = shard_wire.from_pb(request.map)
    except ShardMapError as e:
        _abort(context, bad, shard_wire.REASON_BAD_SHARD_MAP, f"not a valid shard map: {e}")
    if new.version != request.expected_version + 1:
        _abort(
            context,
            bad,
            shard_wire.REASON_BAD_SHARD_MAP,
            f"the new map must be version expected_version + 1 = "
            f"{request.expected_version + 1}, not {new.version}",
        )
    size = len(new.to_json().encode())
    if size > SHARD_MAP_BYTES_MAX:
        _abort(
            context,
            bad,
            shard_wire.REASON_BAD_SHARD_MAP,
            f"the map is {size} bytes as JSON, over the limit of {SHARD_MAP_BYTES_MAX}",
        )
    remaining = context.time_remaining()
    timeout_s = WRITE_TIMEOUT_S if remaining is None else max(0.0, min(WRITE_TIMEOUT_S, remaining))
    res = consensus.write(SetShardMap(request.expected_version, new), timeout_s)
    if res.outcome is Outcome.NOT_APPLIED:
        context.set_trailing_metadata((("kvdir-outcome", "not-applied"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, f"not applied: {res.reason}; retry")
    if res.outcome is Outcome.UNKNOWN:
        context.set_trailing_metadata((("kvdir-outcome", "unknown"),))
        context.abort(
            grpc.StatusCode.ABORTED,
            f"outcome unknown ({res.reason}): read the map (GetShardMap) before retrying",
        )
    result = res.result
    if isinstance(result, Rejected):
        if result.reason is Reject.STALE_SHARD_MAP:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                shard_wire.REASON_STALE_VERSION,
                result.message,
                consensus.read(lambda t: 0 if t.shard_map is None else t.shard_map.version),
            )
        _abort(context, bad, shard_wire.REASON_BAD_SHARD_MAP, result.message)
    assert isinstance(result, ShardMapSet)
    log.info("shard map committed", extra={"version": result.shard_map.version})
    return pb.SetShardMapResponse(map=shard_wire.to_pb(result.shard_map))


def _write(consensus: Consensus, cmd: Command, context: grpc.ServicerContext) -> Result:
    """Propose `cmd`; a write outcome other than applied is the caller's status."""
    remaining = context.time_remaining()
    timeout_s = WRITE_TIMEOUT_S if remaining is None else max(0.0, min(WRITE_TIMEOUT_S, remaining))
    res = consensus.write(cmd, timeout_s)
    if res.outcome is Outcome.NOT_APPLIED:
        context.set_trailing_metadata((("kvdir-outcome", "not-applied"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, f"not applied: {res.reason}; retry")
    if res.outcome is Outcome.UNKNOWN:
        context.set_trailing_metadata((("kvdir-outcome", "unknown"),))
        context.abort(grpc.StatusCode.ABORTED, f"outcome unknown ({res.reason}); retry")
    assert res.result is not None
    if isinstance(res.result, Rejected):
        if res.result.reason is Reject.BAD_MOVE:  # the group's state, not the request's form
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "bad_move", res.result.message)
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad-batch", res.result.message)
    return res.result


def _move_command(request: pb.MoveShardRequest, context: grpc.ServicerContext) -> Command:
    hi = KEY_SPACE if request.hi == 0 else request.hi
    step = request.step
    if step in (pb.MOVE_STEP_FREEZE, pb.MOVE_STEP_BEGIN_IMPORT):
        if not request.lo < hi:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_move", "lo must be below hi")
        kind = FreezeShard if step == pb.MOVE_STEP_FREEZE else BeginImport
        return kind(request.shard_id, request.lo, hi)
    if step == pb.MOVE_STEP_IMPORT_DONE:
        return ImportDone(request.shard_id)
    if step == pb.MOVE_STEP_DROP:
        if request.part >= SHARDS:
            _abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, "bad_move", f"part is 0..{SHARDS - 1}"
            )
        return DropShard(request.shard_id, request.part)
    _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_move", "no move step named")


def move_shard(
    consensus: Consensus, request: pb.MoveShardRequest, context: grpc.ServicerContext
) -> pb.MoveShardResponse:
    result = _write(consensus, _move_command(request, context), context)
    removed = result.removed if isinstance(result, Removed) else 0
    applied = consensus.status().applied_index
    log.info("shard move step", extra={"step": request.step, "shard": request.shard_id})
    return pb.MoveShardResponse(applied_index=applied, removed=removed)


def import_shard(
    consensus: Consensus, request: pb.ImportShardRequest, context: grpc.ServicerContext
) -> pb.ImportShardResponse:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if len(request.commands) > IMPORT_COMMANDS_MAX:
        _abort(context, bad, "bad-batch", f"at most {IMPORT_COMMANDS_MAX} commands per call")
    inner: list[Publish | Remove | ClearNode | ExpireNodes] = []
    for blob in request.commands:  # all decoded before any is proposed: all or none is bad
        if len(blob) > COMMAND_BYTES_MAX - IMPORT_HEAD_BYTES:
            _abort(context, bad, "bad-batch", f"a command of {len(blob)} bytes is too long")
        try:
            cmd = codec.decode(blob)
        except codec.CodecError as e:
            _abort(context, bad, "bad-batch", f"not a command: {e}")
        if not isinstance(cmd, Publish | Remove | ClearNode | ExpireNodes):
            _abort(context, bad, "bad-batch", f"an import cannot carry a {type(cmd).__name__}")
        inner.append(cmd)
    resp = pb.ImportShardResponse()
    for cmd in inner:
        result = _write(consensus, Import(request.shard_id, cmd), context)
        if isinstance(result, Published):
            resp.applied += result.applied
            resp.stale += result.stale
        elif isinstance(result, Removed):
            resp.applied += result.removed
    resp.applied_index = consensus.status().applied_index
    return resp


__all__ = ["import_shard", "move_shard", "set_shard_map"]
