"""Coverage-guided fuzzing with atheris (libFuzzer) of the pure request paths.

Run as ``python -m bench.fuzz.guided TARGET -runs=N [libFuzzer flags]``;
`kvdir fuzz --atheris-runs N` runs every target that way and reads libFuzzer's
own count of executions. Targets (in-process, instrumented, no sockets):

- ``decode``: the KV-event decoder; anything but a Batch or DecodeError is a crash.
- ``directory``: bytes -> one of the directory's write/lookup requests ->
  `directory.validate` -> the Raft command codec (encode, decode, compare) ->
  `Table.apply` on a small table; anything but BadRequest / a protobuf
  DecodeError, or a codec round trip that changes the command, is a crash.

A crash makes libFuzzer exit non-zero and write the input under -artifact_prefix.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import atheris
from google.protobuf.message import DecodeError as ProtoDecodeError

from kvdir.agent.events.decode import DecodeError, decode_batch
from kvdir.directory import codec, validate
from kvdir.directory.commands import Heartbeat, RegisterNode
from kvdir.directory.limits import RequestLimits
from kvdir.directory.table import Table
from kvdir.v1 import directory_pb2 as pb

LIMITS = RequestLimits()
NODE = "n1"


def decode_one(data: bytes) -> None:
    with contextlib.suppress(DecodeError):  # the one refusal the decoder may give
        decode_batch(data)


def _table() -> Table:
    t = Table()
    t.apply(RegisterNode(NODE, "h", "h:1", ("tcp",), 1, 10_000, 0))
    return t


def _command(kind: int, body: bytes) -> object | None:
    """A validated directory command from `body`, or None when refused."""
    try:
        if kind == 0:
            return validate.publish(pb.PublishRequest.FromString(body), LIMITS)
        if kind == 1:
            return validate.remove(pb.RemoveRequest.FromString(body), LIMITS)
        if kind == 2:
            req = pb.RegisterNodeRequest.FromString(body)
            nid, lease = validate.registration(req, 10_000)
            return RegisterNode(
                nid,
                req.host,
                req.agent_endpoint,
                tuple(req.transports),
                req.incarnation,
                lease,
                0,
            )
        if kind == 3:
            req_hb = pb.HeartbeatRequest.FromString(body)
            return Heartbeat(validate.node_id(req_hb.node_id), req_hb.incarnation, 0)
        validate.lookup_chain(pb.LookupRequest.FromString(body), LIMITS)
    except (validate.BadRequest, ProtoDecodeError):
        return None
    return None


def directory_one(data: bytes) -> None:
    if not data:
        return
    cmd = _command(data[0] % 5, data[1:])
    if cmd is None:
        return
    blob = codec.encode(cmd)  # type: ignore[arg-type]
    again = codec.decode(blob)
    if again != cmd:
        raise AssertionError(f"codec round trip changed {cmd!r} into {again!r}")
    _table().apply(again)


TARGETS: dict[str, Callable[[bytes], None]] = {"decode": decode_one, "directory": directory_one}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(f"usage: python -m bench.fuzz.guided {{{','.join(TARGETS)}}} [libFuzzer flags]")
        sys.exit(2)
    atheris.instrument_all()  # every loaded Python function: decoder, validate, codec, table
    atheris.Setup([argv[0], *argv[2:]], TARGETS[argv[1]])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
