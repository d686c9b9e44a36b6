"""Merging the groups' answers to one chain lookup (pure: no I/O, no clock).

A sharded client sends each group the subsequence of the chain that the group
owns, in chain order, as an ordinary Lookup; the group answers as an unsharded
directory does: per holder, the longest prefix of *that subsequence* and its
records. For holder h, group g with owned positions P_g and answered prefix
k_g (0 when h is absent from g's answer or g did not answer), h holds the
chain up to P_g[k_g] as far as g can tell (the whole chain when k_g covers
P_g); h's prefix of the chain is the least of those bounds over every group
that owns a block of it. Records of the positions below it come from the
owning group's answer, each at its rank in that group's subsequence.

Safety: a missing or truncated answer can only lower a bound, so it shortens
a prefix and never lengthens one; every record comes from the one group that
owns its block. An unavailable group therefore ends every prefix at its first
block of the chain: a miss, never an error and never a wrong record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvdir.v1 import directory_pb2 as pb

Positions = Sequence[int] | npt.NDArray[np.int64]
"""The chain positions one group owns, ascending."""

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("addresses", "<u8"),
    ("lengths", "<u4"),
    ("rkeys", "<u4"),
    ("generations", "<u8"),
    ("tiers", "u1"),
)
"""NodeMatch's packed record columns and their element types (little-endian)."""


class Columns(Protocol):
    """Packed record columns of one holder's prefix (NodeMatch and PackedRecords)."""

    @property
    def addresses(self) -> bytes: ...
    @property
    def lengths(self) -> bytes: ...
    @property
    def rkeys(self) -> bytes: ...
    @property
    def generations(self) -> bytes: ...
    @property
    def tiers(self) -> bytes: ...


def subsequence(chain: Sequence[bytes], positions: Sequence[int]) -> list[bytes]:
    """The hashes at `positions` of `chain`, in order (one group's part)."""
    return [chain[i] for i in positions]


def holder_prefixes(
    chain_blocks: int,
    positions: Mapping[str, Positions],
    answers: Mapping[str, pb.LookupResponse | None],
) -> dict[str, int]:
    """Each holder's prefix of the whole chain (holders with 0 left out).

    `positions[g]` are the chain positions group g owns (ascending, and
    together every position exactly once); `answers[g]` is g's answer to the
    Lookup of its subsequence, or None when g could not be asked."""
    return prefix_bounds(
        chain_blocks,
        positions,
        {
            g: None if resp is None else {m.node_id: m.prefix_blocks for m in resp.matches}
            for g, resp in answers.items()
        },
    )


def prefix_bounds(
    chain_blocks: int,
    positions: Mapping[str, Positions],
    prefixes: Mapping[str, Mapping[str, int] | None],
) -> dict[str, int]:
    """`holder_prefixes` from each group's answer reduced to {holder: prefix of the
    group's subsequence} (None: the group could not be asked)."""
    seen: dict[str, dict[str, int]] = {}
    for g, got in prefixes.items():
        if got is None or g not in positions:
            continue
        for node_id, k in got.items():
            seen.setdefault(node_id, {})[g] = k
    out: dict[str, int] = {}
    for node_id, per_group in seen.items():
        bound = chain_blocks
        for g, owned in positions.items():
            k = min(per_group.get(g, 0), len(owned))
            if k < len(owned):
                bound = min(bound, int(owned[k]))
        if bound > 0:
            out[node_id] = bound
    return out


def merge_lookup(
    chain_blocks: int,
    positions: Mapping[str, Positions],
    answers: Mapping[str, pb.LookupResponse | None],
    max_nodes: int,
    omit_records: bool = False,
) -> pb.LookupResponse:
    """One LookupResponse for the whole chain, as an unsharded directory gives it:
    best first (longer prefix, then node id), at most `max_nodes` holders."""
    prefixes = holder_prefixes(chain_blocks, positions, answers)
    order = sorted(prefixes.items(), key=lambda x: (-x[1], x[0]))[:max_nodes]
    by_group = {
        g: {m.node_id: m for m in resp.matches}
        for g, resp in answers.items()
        if resp is not None and g in positions
    }
    owned = {g: np.asarray(p, dtype=np.int64) for g, p in positions.items()}
    resp = pb.LookupResponse()
    for node_id, prefix in order:
        first = _owner_of(0, owned)
        src = by_group[first][node_id]
        nm = resp.matches.add(
            node_id=node_id,
            prefix_blocks=prefix,
            host=src.host,
            agent_endpoint=src.agent_endpoint,
            transports=src.transports,
        )
        if not omit_records:
            fill_records(nm, prefix, owned, {g: m.get(node_id) for g, m in by_group.items()})
    lead = answers.get(_owner_of(0, owned)) if owned else None
    if lead is not None:
        resp.read.CopyFrom(lead.read)
    return resp


def _owner_of(position: int, owned: Mapping[str, np.ndarray]) -> str:
    for g, p in owned.items():
        if len(p) and p[0] == position:
            return g
    raise ValueError(f"no group owns chain position {position}")


def fill_records(
    nm: pb.NodeMatch,
    prefix: int,
    owned: Mapping[str, np.ndarray],
    matches: Mapping[str, Columns | None],
) -> None:
    """Interleave the owning groups' record columns into chain order, up to `prefix`
    (`matches[g]`: the holder's records of g's subsequence, a NodeMatch or a
    table's PackedRecords)."""
    parts: list[tuple[str, Columns, int]] = []
    at: list[np.ndarray] = []
    for g, p in owned.items():
        below = int(np.searchsorted(p, prefix))  # positions of g inside the prefix
        if below == 0:
            continue
        m = matches.get(g)
        # holder_prefixes bounded `prefix` by p[k_g], so g answered >= `below` blocks
        # (each column's length is checked below).
        assert m is not None, "merge bound broken"
        parts.append((g, m, below))
        at.append(p[:below])
    # One scatter per column: the groups' leading records joined as bytes (cheap
    # slices), then put at their chain positions, which cover 0..prefix-1 once.
    where = np.concatenate(at) if len(at) > 1 else None
    for name, dtype in _COLUMNS:
        size = np.dtype(dtype).itemsize
        pieces = []
        for g, m, below in parts:
            col: bytes = getattr(m, name)
            if len(col) < below * size:
                raise ValueError(f"group {g!r} sent {len(col) // size} {name} for {below} blocks")
            pieces.append(col[: below * size])
        if where is None:  # one group holds the whole prefix: already in chain order
            setattr(nm, name, pieces[0])
            continue
        out = np.empty(prefix, dtype=dtype)
        out[where] = np.frombuffer(b"".join(pieces), dtype=dtype)
        setattr(nm, name, out.tobytes())
