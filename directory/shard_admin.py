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
from kvdir.core.shard_map import ShardMapError
from kvdir.directory.commands import Reject, Rejected, SetShardMap, ShardMapSet
from kvdir.directory.consensus.port import Consensus, Outcome
from kvdir.directory.limits import SHARD_MAP_BYTES_MAX
from kvdir.directory.shard_view import HOME_GROUP, ShardView
from kvdir.v1 import directory_pb2 as pb

log = logging.getLogger("kvdir.directory.shards")

WRITE_TIMEOUT_S = 10.0


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


__all__ = ["set_shard_map"]
