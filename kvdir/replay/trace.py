"""Mooncake-format request traces: parsing, slicing, turn recovery, a synthetic default.

One JSON object a line: `timestamp` (ms from the start), `input_length` and
`output_length` (tokens) and `hash_ids`, the prefix block hashes with a block
size of 512 tokens. The ids are prefix-chained by construction (equal ids mean
equal token prefixes), so a block id also names its whole prefix; that is what
turn recovery and the "ideal" row rely on.

Turns are not in the trace; they are recovered from shared prefixes: a
request's parent is the latest earlier request whose whole chain (or all of
it but a trailing partial block) is a prefix of this one's, turn = parent's
turn + 1; a request with no such parent is turn 1. A system prompt shared by
every conversation is too short to be anyone's whole chain, so it does not
link unrelated conversations.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
"""Mooncake's block size: one hash id per 512 tokens."""

LINE_BYTES_MAX = 1 << 20
REQUESTS_MAX = 1_000_000
CHAIN_BLOCKS_MAX = 4096
"""The agent's limit on one chain (agent/service.py CHAIN_BLOCKS_MAX)."""


class TraceError(ValueError):
    """The trace file is missing or malformed (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    turn: int = 1
    parent: int = -1
    """Index of the previous turn of the same conversation (-1: turn 1)."""


def _field_int(obj: dict[str, object], key: str, where: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return v


def parse_line(line: str, index: int, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    ts = obj.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number, got {ts!r}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if len(ids) > CHAIN_BLOCKS_MAX:
        raise TraceError(f"{where}: {len(ids)} blocks (at most {CHAIN_BLOCKS_MAX})")
    inp = _field_int(obj, "input_length", where)
    if inp > len(ids) * TRACE_BLOCK_TOKENS:
        raise TraceError(
            f"{where}: input_length {inp} needs more than the {len(ids)} blocks in hash_ids"
        )
    return Request(index, ts / 1000.0, inp, _field_int(obj, "output_length", where), tuple(ids))


def read_trace(path: str | Path, limit: int = REQUESTS_MAX, start_s: float = 0.0) -> list[Request]:
    """The first `limit` requests at or after `start_s`, re-timed to start at 0, turns set."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    out: list[Request] = []
    last = 0.0
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if len(out) >= min(limit, REQUESTS_MAX):
                break
            if len(line) > LINE_BYTES_MAX:
                raise TraceError(f"{p}:{n}: line longer than {LINE_BYTES_MAX} bytes")
            if not line.strip():
                continue
            r = parse_line(line, len(out), f"{p}:{n}")
            if r.arrival_s < last:
                raise TraceError(f"{p}:{n}: timestamps go backwards")
            last = r.arrival_s
            if r.arrival_s >= start_s:
                out.append(r)
    if not out:
        raise TraceError(f"{p}: no requests (after {start_s:.0f} s)")
    check_chained(out, str(p))
    t0 = out[0].arrival_s
    return recover_turns(replace(r, arrival_s=r.arrival_s - t0) for r in out)


def check_chained(requests: Sequence[Request], where: str = "trace") -> None:
    """Every id must always sit behind the same id (prefix-chained, as Mooncake's are).

    The replay's caches and the directory key blocks by id alone, so an id that
    reappeared after a different prefix would be served with the wrong KV.
    """
    before: dict[int, int] = {}
    for r in requests:
        prev = -1
        for b in r.hash_ids:
            known = before.setdefault(b, prev)
            if known != prev:
                raise TraceError(
                    f"{where}: request {r.index + 1}: hash id {b} follows {prev}, earlier "
                    f"{known} (-1: first); hash_ids must be prefix-chained"
                )
            prev = b


def recover_turns(requests: Iterable[Request]) -> list[Request]:
    """Index requests 0..n-1 in order and set each one's turn and parent (see module doc)."""
    ends: dict[int, int] = {}
    """last block id of a chain (or the one before a partial last block) -> request index."""
    out: list[Request] = []
    for i, r in enumerate(requests):
        parent = -1
        ids = r.hash_ids
        # j >= 1: a one-block chain (a bare system prompt) is nobody's conversation.
        for j in range(len(ids) - 1, 0, -1):
            p = ends.get(ids[j])
            if p is not None and out[p].hash_ids[: j + 1] == ids[: j + 1]:
                parent = p
                break
        turn = out[parent].turn + 1 if parent >= 0 else 1
        out.append(replace(r, index=i, turn=turn, parent=parent))
        if ids:
            ends[ids[-1]] = i
            if len(ids) >= 2 and r.input_tokens % TRACE_BLOCK_TOKENS:
                ends[ids[-2]] = i
    return out


def reusable_blocks(requests: Sequence[Request]) -> list[int]:
    """Per request, its leading blocks seen in any earlier request (an infinite global cache)."""
    seen: set[int] = set()
    out = []
    for r in requests:
        k = 0
        for x in r.hash_ids:
            if x not in seen:
                break
            k += 1
        out.append(k)
        seen.update(r.hash_ids)
    return out


def compress(requests: Sequence[Request], speedup: float) -> list[Request]:
    """Arrivals `speedup` times denser (the simulated cluster sees a busier hour)."""
    if speedup <= 0:
        raise TraceError(f"speedup must be > 0, got {speedup}")
    return [replace(r, arrival_s=r.arrival_s / speedup) for r in requests]


def synthesize(
    conversations: int = 120,
    seed: int = 7,
    duration_s: float = 600.0,
    system_blocks: int = 1,
    turns_max: int = 6,
) -> list[Request]:
    """A deterministic Mooncake-shaped trace: multi-turn chats on a shared system prompt.

    Each conversation opens with a 2k-8k-token context (documents, as in the
    seed's workload), and every later turn appends the previous answer and a
    new question, so its chain extends the previous turn's. Turns are minutes
    apart; conversations start uniformly over `duration_s`.
    """
    rng = random.Random(seed)
    next_id = system_blocks
    events: list[tuple[float, int, list[int], int]] = []
    for _ in range(conversations):
        t = rng.uniform(0, duration_s * 0.6)
        tokens = rng.randint(2_000, 8_000)
        full = list(range(system_blocks))
        for _ in range(rng.randint(1, turns_max)):
            chain = list(full)
            while len(chain) * TRACE_BLOCK_TOKENS < tokens:
                chain.append(next_id)
                next_id += 1
            out_tokens = rng.randint(50, 600)
            events.append((t, tokens, chain, out_tokens))
            # The next turn keeps this one's full blocks and appends the answer and a
            # new question; a partial last block changes, so it gets a new id.
            full = chain[: tokens // TRACE_BLOCK_TOKENS]
            tokens += out_tokens + rng.randint(30, 400)
            t += rng.uniform(20, 120)
    events.sort(key=lambda e: e[0])
    return recover_turns(Request(0, round(t, 3), tok, out, tuple(ch)) for t, tok, ch, out in events)


def to_jsonl(requests: Iterable[Request]) -> Iterator[str]:
    for r in requests:
        yield json.dumps(
            {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.hash_ids),
            }
        )
