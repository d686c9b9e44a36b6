"""The shard map: which Raft group owns which part of the directory's key space.

Pure and deterministic (no I/O, no protobuf): the directory's state machine
keeps the committed map, and every client routes by its own copy of it.

The key of a block is a 64-bit mix of its hash (blake2b, keyed by nothing),
not the hash's own bytes. Block hashes come from several schemes (vLLM's
sha256 or builtin `hash` chains, kvdir's own), some of them short or not
uniform in their leading bytes; the mix makes every scheme spread evenly,
so that no prefix, model or tenant can make one shard hot. The namespace is
left out on purpose: a chain routes the same way in every namespace, and a
client can route a batch without knowing which namespace each hash is in.

The space `[0, 2**64)` is cut into contiguous shards, each owned by one
group. A shard is split in place (both halves stay with its group) and then
moved to another group; the map's version goes up by one with each change,
so a replica and a client can tell which of two maps is newer.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

KEY_SPACE = 1 << 64
SHARDS_MAX = 4096  # a map is sent whole in every refusal and Watch: keep it small
GROUPS_MAX = 1024
SHARD_ID_END = 1 << 32
SERVING: Literal["serving"] = "serving"
MOVING: Literal["moving"] = "moving"
ShardState = Literal["serving", "moving"]


class ShardMapError(ValueError):
    """A map, or a change asked of it, that would break the map's invariants."""


def shard_key(block_hash: bytes) -> int:
    """The 64-bit routing key of a block hash."""
    return int.from_bytes(hashlib.blake2b(block_hash, digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class Group:
    """One Raft group: its id and the gRPC addresses of its replicas."""

    group_id: str
    replicas: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Shard:
    """Keys `[lo, hi)`, owned by `group_id`.

    `moving` means a move to `target_group` has started: the owner still
    serves and takes writes until the map that names the target as the owner
    commits.
    """

    shard_id: int
    lo: int
    hi: int
    group_id: str
    state: ShardState = SERVING
    target_group: str = ""


@dataclass(frozen=True, slots=True)
class ShardMap:
    version: int
    groups: tuple[Group, ...]
    shards: tuple[Shard, ...]
    _los: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate(self.version, self.groups, self.shards)
        object.__setattr__(self, "_los", tuple(s.lo for s in self.shards))

    # -- routing ---------------------------------------------------------

    def shard_of_key(self, key: int) -> Shard:
        return self.shards[bisect.bisect_right(self._los, key) - 1]

    def shard_of(self, block_hash: bytes) -> Shard:
        return self.shard_of_key(shard_key(block_hash))

    def group(self, group_id: str) -> Group:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise ShardMapError(f"no group {group_id!r} in shard map v{self.version}")

    def shards_of_group(self, group_id: str) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.group_id == group_id)

    def owns(self, group_id: str, key: int) -> bool:
        return self.shard_of_key(key).group_id == group_id

    def positions_by_group(self, hashes: Sequence[bytes]) -> dict[str, list[int]]:
        """Indexes into `hashes`, grouped by the group that owns each hash.

        Groups appear in the order of their first block, so the answer is
        deterministic for a given map and input.
        """
        out: dict[str, list[int]] = {}
        los = self._los
        shards = self.shards
        for i, h in enumerate(hashes):
            key = int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "big")
            gid = shards[bisect.bisect_right(los, key) - 1].group_id
            out.setdefault(gid, []).append(i)
        return out

    # -- changes (each returns the next version) ---------------------------

    def with_split(self, shard_id: int, new_shard_id: int, at: int | None = None) -> ShardMap:
        """Cut shard `shard_id` at key `at` (default: its middle); the upper
        half becomes `new_shard_id` on the same group."""
        s = self._shard(shard_id)
        if s.state != SERVING:
            raise ShardMapError(f"shard {shard_id} is {s.state}; finish that first")
        if any(x.shard_id == new_shard_id for x in self.shards):
            raise ShardMapError(f"shard id {new_shard_id} is taken")
        cut = (s.lo + s.hi) // 2 if at is None else at
        if not s.lo < cut < s.hi:
            raise ShardMapError(f"split point {cut} is not inside shard {shard_id}")
        lower = replace(s, hi=cut)
        upper = replace(s, shard_id=new_shard_id, lo=cut)
        shards = [x for x in self.shards if x.shard_id != shard_id] + [lower, upper]
        return ShardMap(self.version + 1, self.groups, tuple(sorted(shards, key=lambda x: x.lo)))

    def with_move_started(self, shard_id: int, target_group: str) -> ShardMap:
        s = self._shard(shard_id)
        self.group(target_group)
        if s.state != SERVING:
            raise ShardMapError(f"shard {shard_id} is {s.state}")
        if target_group == s.group_id:
            raise ShardMapError(f"shard {shard_id} is already on group {target_group!r}")
        return self._with(replace(s, state=MOVING, target_group=target_group))

    def with_move_done(self, shard_id: int) -> ShardMap:
        s = self._shard(shard_id)
        if s.state != MOVING:
            raise ShardMapError(f"shard {shard_id} is not moving")
        return self._with(replace(s, group_id=s.target_group, state=SERVING, target_group=""))

    def with_move_aborted(self, shard_id: int) -> ShardMap:
        s = self._shard(shard_id)
        if s.state != MOVING:
            raise ShardMapError(f"shard {shard_id} is not moving")
        return self._with(replace(s, state=SERVING, target_group=""))

    def with_groups(self, groups: Iterable[Group]) -> ShardMap:
        """Replace the group list (a replica added or moved); every shard's
        group must still be in it."""
        return ShardMap(self.version + 1, tuple(groups), self.shards)

    def _shard(self, shard_id: int) -> Shard:
        for s in self.shards:
            if s.shard_id == shard_id:
                return s
        raise ShardMapError(f"no shard {shard_id} in shard map v{self.version}")

    def _with(self, changed: Shard) -> ShardMap:
        shards = tuple(changed if s.shard_id == changed.shard_id else s for s in self.shards)
        return ShardMap(self.version + 1, self.groups, shards)

    # -- text form (config files, `kvdir ctl shards`) -----------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "groups": [{"id": g.group_id, "replicas": list(g.replicas)} for g in self.groups],
                "shards": [
                    {
                        "id": s.shard_id,
                        "lo": s.lo,
                        "hi": s.hi,
                        "group": s.group_id,
                        "state": s.state,
                        "target": s.target_group,
                    }
                    for s in self.shards
                ],
            },
            sort_keys=True,
        )

    @staticmethod
    def from_json(text: str) -> ShardMap:
        try:
            d: Any = json.loads(text)
            groups = tuple(
                Group(str(g["id"]), tuple(str(r) for r in g["replicas"])) for g in d["groups"]
            )
            shards = tuple(
                Shard(
                    int(s["id"]),
                    int(s["lo"]),
                    int(s["hi"]),
                    str(s["group"]),
                    _state(s.get("state", SERVING)),
                    str(s.get("target", "")),
                )
                for s in d["shards"]
            )
            return ShardMap(int(d["version"]), groups, shards)
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(Infinity)
            if isinstance(e, ShardMapError):
                raise
            raise ShardMapError(f"not a shard map: {e}") from e


def even_map(groups: Sequence[Group], shards_per_group: int = 1) -> ShardMap:
    """Version 1: the key space cut into equal shards, dealt to the groups in turn."""
    if not groups:
        raise ShardMapError("a shard map needs at least one group")
    if shards_per_group < 1:
        raise ShardMapError("shards_per_group must be at least 1")
    n = len(groups) * shards_per_group
    bounds = [KEY_SPACE * i // n for i in range(n + 1)]
    shards = tuple(
        Shard(i, bounds[i], bounds[i + 1], groups[i % len(groups)].group_id) for i in range(n)
    )
    return ShardMap(1, tuple(groups), shards)


def _state(value: object) -> ShardState:
    if value == SERVING:
        return SERVING
    if value == MOVING:
        return MOVING
    raise ShardMapError(f"unknown shard state {value!r}")


def _validate(version: int, groups: tuple[Group, ...], shards: tuple[Shard, ...]) -> None:
    if not 1 <= version < KEY_SPACE:  # a uint64 at the wire
        raise ShardMapError(f"shard map version must be 1..2**64-1, not {version}")
    if not groups or len(groups) > GROUPS_MAX:
        raise ShardMapError(f"a shard map has 1 to {GROUPS_MAX} groups, not {len(groups)}")
    if not shards or len(shards) > SHARDS_MAX:
        raise ShardMapError(f"a shard map has 1 to {SHARDS_MAX} shards, not {len(shards)}")
    ids = [g.group_id for g in groups]
    if len(set(ids)) != len(ids) or any(not i for i in ids):
        raise ShardMapError("group ids must be distinct and non-empty")
    for g in groups:
        if not g.replicas:
            raise ShardMapError(f"group {g.group_id!r} has no replicas")
    known = set(ids)
    if len({s.shard_id for s in shards}) != len(shards):
        raise ShardMapError("shard ids must be distinct")
    if any(not 0 <= s.shard_id < SHARD_ID_END for s in shards):
        raise ShardMapError(f"shard ids must be 0..{SHARD_ID_END - 1} (a uint32 at the wire)")
    expect = 0
    for s in shards:
        if s.lo != expect:
            raise ShardMapError(
                f"shard {s.shard_id} starts at {s.lo}, expected {expect}: "
                "shards must be sorted, without gaps or overlaps"
            )
        if s.hi <= s.lo:
            raise ShardMapError(f"shard {s.shard_id} is empty")
        if s.group_id not in known:
            raise ShardMapError(f"shard {s.shard_id} names unknown group {s.group_id!r}")
        if s.state == MOVING and s.target_group not in known:
            raise ShardMapError(f"shard {s.shard_id} moves to unknown group {s.target_group!r}")
        if s.state == SERVING and s.target_group:
            raise ShardMapError(f"shard {s.shard_id} is serving but names a move target")
        expect = s.hi
    if expect != KEY_SPACE:
        raise ShardMapError("shards must cover the whole key space [0, 2**64)")
