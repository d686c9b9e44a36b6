"""Pure decoding of vLLM and SGLang KV-event messages (no sockets, no clock).

A message is three ZMQ frames ``[topic, seq, payload]``: ``seq`` is 8 bytes
big-endian, ``payload`` a msgpack array ``[ts, events]`` (vLLM 0.9) or
``[ts, events, data_parallel_rank]`` (later vLLM; SGLang's ``attn_dp_rank``,
possibly nil). An event is either a positional array ``[tag, field, ...]``
(vLLM <= 0.23, older SGLang) or a map tagged ``"type"`` (vLLM >= 0.24, newer
SGLang). Fields were added over versions (see ../shared notes and
docs/events.md): unknown fields are ignored, missing optional ones default.

A malformed batch raises `DecodeError`; a malformed event inside an otherwise
good batch is skipped and counted in `Batch.bad_events`, so one bad event does
not cost its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

Hash = int | bytes
"""A block hash as the engine sent it (normalised by `agent.events.hashes`)."""

SEQ_BYTES = 8
END_SEQ = -1
"""The replay stream's end marker (ff x 8)."""

PAYLOAD_BYTES_MAX = 64 * 1024 * 1024
EVENTS_PER_BATCH_MAX = 1_000_000


class DecodeError(ValueError):
    """A message that is not a KV-event batch; `reason` is a stable metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: list[Hash]
    parent: Hash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None
    bad_events: int = 0


def decode_seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes big-endian, signed so the end marker reads -1."""
    if len(frame) != SEQ_BYTES:
        raise DecodeError("bad-seq", f"sequence frame of {len(frame)} bytes (want 8)")
    return int.from_bytes(frame, "big", signed=True)


def _hash_list(value: Any) -> list[Hash]:
    if type(value) is not list:
        raise DecodeError("bad-event", "block_hashes is not an array")
    return value


def _opt_str(value: Any) -> str | None:
    if value is None or type(value) is str:
        return value
    raise DecodeError("bad-event", "expected a string or nil")


def _opt_int(value: Any) -> int | None:
    if value is None or type(value) is int:
        return value
    raise DecodeError("bad-event", "expected an integer or nil")


def _parent(value: Any) -> Hash | None:
    if value is None or type(value) in (int, bytes):
        return value  # type: ignore[no-any-return]
    raise DecodeError("bad-event", "parent_block_hash is not a hash")


def _stored(
    hashes: Any,
    parent: Any,
    tokens: Any,
    block_size: Any,
    medium: Any = None,
    lora_name: Any = None,
    extra_keys: Any = None,
    group_idx: Any = None,
) -> BlockStored:
    if type(tokens) is not list:
        raise DecodeError("bad-event", "token_ids is not an array")
    if type(block_size) is not int or block_size <= 0:
        raise DecodeError("bad-event", "block_size is not a positive integer")
    if extra_keys is not None and type(extra_keys) is not list:
        raise DecodeError("bad-event", "extra_keys is not an array")
    return BlockStored(
        _hash_list(hashes),
        _parent(parent),
        tokens,
        block_size,
        _opt_str(medium),
        _opt_str(lora_name),
        extra_keys,
        _opt_int(group_idx),
    )


def _from_map(raw: dict[Any, Any]) -> Event:
    tag, get = raw.get("type"), raw.get
    if tag == "BlockStored":
        for key in ("block_hashes", "token_ids", "block_size"):
            if key not in raw:
                raise DecodeError("bad-event", f"BlockStored without {key}")
        return _stored(
            raw["block_hashes"],
            get("parent_block_hash"),
            raw["token_ids"],
            raw["block_size"],
            get("medium"),
            get("lora_name"),
            get("extra_keys"),
            get("group_idx"),
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in raw:
            raise DecodeError("bad-event", "BlockRemoved without block_hashes")
        return BlockRemoved(
            _hash_list(raw["block_hashes"]), _opt_str(get("medium")), _opt_int(get("group_idx"))
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError("unknown-event", f"unknown event type {tag!r}")


# Positional layouts (vLLM <= 0.23; SGLang's copy stops after medium):
#   BlockStored  [tag, block_hashes, parent, token_ids, block_size, lora_id,
#                 medium, lora_name, extra_keys, group_idx, spec_kind, spec_window]
#   BlockRemoved [tag, block_hashes, medium, group_idx]
_STORED_FIELDS_MIN = 5
_STORED_MEDIUM, _STORED_LORA_NAME, _STORED_EXTRA, _STORED_GROUP = 6, 7, 8, 9


def _from_array(raw: list[Any]) -> Event:
    tag, n = raw[0], len(raw)
    if tag == "BlockStored":
        if n < _STORED_FIELDS_MIN:
            raise DecodeError("bad-event", f"BlockStored array of {n} fields")
        return _stored(
            raw[1],
            raw[2],
            raw[3],
            raw[4],
            raw[_STORED_MEDIUM] if n > _STORED_MEDIUM else None,
            raw[_STORED_LORA_NAME] if n > _STORED_LORA_NAME else None,
            raw[_STORED_EXTRA] if n > _STORED_EXTRA else None,
            raw[_STORED_GROUP] if n > _STORED_GROUP else None,
        )
    if tag == "BlockRemoved":
        if n < 2:
            raise DecodeError("bad-event", "BlockRemoved array without block_hashes")
        return BlockRemoved(
            _hash_list(raw[1]),
            _opt_str(raw[2]) if n > 2 else None,
            _opt_int(raw[3]) if n > 3 else None,
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError("unknown-event", f"unknown event type {tag!r}")


def decode_event(raw: Any) -> Event:
    """One event, positional or tagged map."""
    kind = type(raw)
    if kind is dict:
        return _from_map(raw)
    if kind is list and raw:
        return _from_array(raw)
    raise DecodeError("bad-event", "an event is neither a tagged map nor a tagged array")


def _unpack(payload: bytes) -> Any:
    if len(payload) > PAYLOAD_BYTES_MAX:
        raise DecodeError("too-large", f"payload of {len(payload)} bytes")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        # msgpack raises ExtraData, FormatError, StackError (ValueError kin),
        # UnicodeDecodeError and friends for hostile bytes.
        raise DecodeError("bad-msgpack", f"not msgpack: {e}") from e


def decode_batch(payload: bytes) -> Batch:
    """A payload -> Batch; malformed events are skipped and counted."""
    raw = _unpack(payload)
    if type(raw) is not list or len(raw) not in (2, 3):
        raise DecodeError("bad-batch", "a batch is [ts, events] or [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    if type(ts) not in (float, int) or type(events) is not list:
        raise DecodeError("bad-batch", "batch ts or events of the wrong type")
    if len(events) > EVENTS_PER_BATCH_MAX:
        raise DecodeError("too-large", f"{len(events)} events in one batch")
    rank = raw[2] if len(raw) == 3 else None
    if rank is not None and (type(rank) is not int or rank < 0):
        raise DecodeError("bad-batch", "data_parallel_rank is not a rank")
    out: list[Event] = []
    bad = 0
    for e in events:
        try:
            out.append(decode_event(e))
        except DecodeError:
            bad += 1
    return Batch(float(ts), out, rank, bad)
