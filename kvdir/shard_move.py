"""`kvdir ctl shards move SHARD --to GROUP`: the move protocol, run by the operator's
command (docs/sharding.md, "Re-sharding online"), every step bounded by one deadline.

1. g0's map: SHARD moving to GROUP (compare-and-set).
2. GROUP: BeginImport.
3. The source's Watch from a snapshot: the shard's entries, then every later
   command cut down to the shard, go to GROUP's ImportShard in log order.
4. Once the snapshot is in, the source commits FreezeShard; the import goes on
   until the stream has passed the freeze's index, then GROUP commits ImportDone.
5. g0's map: SHARD owned by GROUP.
6. The source drops the shard, a 256th of its table per command.

A step whose outcome was unknown (a leader change, a replica killed mid-call) is
retried; if the retry is refused because the first try did apply, the move goes
on. A source Watch that breaks is opened again on the next source replica from
the last index imported (`import_until_frozen`). Any other failure stops the move
where it is and says which step failed (resuming or undoing a move whose
orchestrator stopped is not automated yet; docs/sharding.md).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvdir.core import shard_wire
from kvdir.core.security import ClientSecurity
from kvdir.core.shard_map import ShardMap, ShardMapError
from kvdir.directory import codec, snapshot
from kvdir.directory.block_index import SHARDS
from kvdir.directory.commands import ClearNode, Publish
from kvdir.directory.shard_admin import IMPORT_COMMANDS_MAX
from kvdir.directory.shard_fence import Range
from kvdir.directory.shard_import import Importable, snapshot_publishes, within
from kvdir.ops import OpsError
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

T = TypeVar("T")
SNAPSHOT_BYTES_MAX = 8 << 30
RETRY_PAUSE_S = 0.2
_WATCH_OPENS_MAX = 64
"""Watch streams one move may open on the source (a pause after each round of replicas)."""


class Mover:
    def __init__(self, security: ClientSecurity, deadline: float, say: Callable[[str], None]):
        self.security = security
        self.deadline = deadline
        self.say = say

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OpsError("the move ran out of time (--timeout); it stopped where it was")
        return left

    def on_group(
        self,
        addrs: tuple[str, ...],
        what: str,
        call: Callable[[grpc.Channel], T],
        settled: Callable[[], T | None] = lambda: None,
    ) -> T:
        """`call` on the group's replicas in turn until one answers; UNAVAILABLE and
        an unknown outcome (ABORTED, or UNAVAILABLE that the replica did not say was
        not applied: the connection broke mid-call) are retried, anything else
        stops. A retry that is refused after an unknown outcome asks `settled`
        whether the first try did apply (its answer, then) before it gives up."""
        last = "no replica answered"
        unknown = False
        while True:
            for addr in addrs:
                self.left()
                with self.security.channel(addr) as ch:
                    try:
                        return call(ch)
                    except grpc.RpcError as e:
                        last = f"{addr}: {e.details() or e.code().name}"
                        if e.code() == grpc.StatusCode.ABORTED or _maybe_applied(e):
                            unknown = True
                        elif e.code() != grpc.StatusCode.UNAVAILABLE:
                            done = settled() if unknown else None
                            if done is not None:
                                return done
                            raise OpsError(f"{what}: {last}") from e
            if self.deadline - time.monotonic() < RETRY_PAUSE_S:
                raise OpsError(f"{what}: {last}")
            time.sleep(RETRY_PAUSE_S)

    def step(
        self, addrs: tuple[str, ...], step: int, shard: Range, part: int = 0
    ) -> pb.MoveShardResponse:
        req = pb.MoveShardRequest(
            step=step,  # type: ignore[arg-type]
            shard_id=shard.shard_id,
            lo=shard.lo,
            hi=shard.hi % (1 << 64),
            part=part,
        )
        name = pb.MoveStep.Name(step)  # type: ignore[arg-type]
        # ImportDone and a drop part are refused when asked again once applied: after
        # an unknown outcome that refusal means the first try did it.
        again_refused = step in (pb.MOVE_STEP_IMPORT_DONE, pb.MOVE_STEP_DROP)
        return self.on_group(
            addrs,
            name,
            lambda ch: pb_grpc.DirectoryAdminStub(ch).MoveShard(req, timeout=self.left()),
            lambda: pb.MoveShardResponse() if again_refused else None,
        )

    def set_map(
        self,
        home: tuple[str, ...],
        old: ShardMap,
        new: ShardMap,
        fetch: Callable[[], ShardMap],
    ) -> None:
        req = pb.SetShardMapRequest(expected_version=old.version, map=shard_wire.to_pb(new))
        self.on_group(
            home,
            f"shard map v{new.version}",
            lambda ch: pb_grpc.DirectoryAdminStub(ch).SetShardMap(req, timeout=self.left()),
            lambda: pb.SetShardMapResponse(map=req.map) if fetch() == new else None,
        )
        self.say(f"shard map v{new.version} committed")

    def send(self, target: tuple[str, ...], shard: Range, cmds: list[Importable]) -> None:
        for i in range(0, len(cmds), IMPORT_COMMANDS_MAX):
            req = pb.ImportShardRequest(
                shard_id=shard.shard_id,
                commands=[codec.encode(c) for c in cmds[i : i + IMPORT_COMMANDS_MAX]],
            )
            self.on_group(
                target,
                "ImportShard",
                lambda ch, req=req: pb_grpc.DirectoryAdminStub(ch).ImportShard(  # type: ignore[misc]
                    req, timeout=self.left()
                ),
            )

    def import_until_frozen(
        self, source: tuple[str, ...], target: tuple[str, ...], shard: Range
    ) -> None:
        """Steps 3 and 4: the source's Watch into the target, the freeze in between.

        A Watch that breaks (its replica killed, restarted, or cut off) is opened
        again on the next source replica from the last index imported: the move
        goes on through a source leader's death. When that replica's history no
        longer reaches back there and the stream starts with a snapshot, the
        target's partial copy is cleared first (an imported ClearNode of every node
        imported so far, which the target applies to the shard's keys only)."""
        state = _Import()
        for attempt in range(_WATCH_OPENS_MAX):
            addr = source[attempt % len(source)]
            if attempt and attempt % len(source) == 0:
                time.sleep(min(RETRY_PAUSE_S, max(0.0, self.left() - RETRY_PAUSE_S)))
            try:
                with self.security.channel(addr) as ch:
                    stream: Iterable[pb.WatchEvent] = pb_grpc.PrefixDirectoryStub(ch).Watch(
                        pb.WatchRequest(from_index=state.last), timeout=self.left()
                    )
                    if self._follow(stream, source, target, shard, state):
                        return
                    why = "it ended"
            except grpc.RpcError as e:
                why = e.details() or e.code().name
            self.left()  # out of time: stop here, said so
            self.say(f"the source's Watch on {addr} broke ({why}); again from index {state.last}")
        raise OpsError(f"the source's Watch broke {_WATCH_OPENS_MAX} times; the move stopped")

    def _follow(
        self,
        stream: Iterable[pb.WatchEvent],
        source: tuple[str, ...],
        target: tuple[str, ...],
        shard: Range,
        state: _Import,
    ) -> bool:
        """Import what `stream` brings; True once it has passed the freeze."""
        chunks: list[bytes] = []
        for ev in stream:
            kind = ev.WhichOneof("event")
            if kind == "snapshot":
                chunks.append(ev.snapshot.data)
                if sum(map(len, chunks)) > SNAPSHOT_BYTES_MAX:
                    raise OpsError("the source's snapshot is over the import bound")
                if not ev.snapshot.last:
                    continue
                table, _, _ = snapshot.load(io.BytesIO(b"".join(chunks)), "the source's snapshot")
                chunks = []
                cmds: list[Importable] = state.clears()  # an older partial copy goes first
                cmds += snapshot_publishes(table, shard)
                self.send(target, shard, state.seen(cmds))
                state.last = ev.snapshot.index
                self.say(f"imported the source's snapshot at index {ev.snapshot.index}")
                continue
            if kind == "entries":
                new = zip(ev.entries.indexes, ev.entries.commands, strict=True)
                cut = [within(codec.decode(b), shard) for i, b in new if i > state.last]
                self.send(target, shard, state.seen([c for c in cut if c is not None]))
            state.last = max(state.last, ev.applied_index)
            if state.frozen_at is None:
                state.frozen_at = self.step(source, pb.MOVE_STEP_FREEZE, shard).applied_index
                self.say(f"source frozen at index {state.frozen_at}")
            if state.last >= state.frozen_at:
                return True
        return False


@dataclass
class _Import:
    """Where an import stands, across the Watch streams it reads."""

    last: int = 0
    """The source's last index whose commands the target has (0: none yet)."""
    frozen_at: int | None = None
    nodes: dict[str, int] = field(default_factory=dict)
    """Node id -> incarnation of every write imported (what a partial copy may hold)."""
    copied: bool = False

    def seen(self, cmds: list[Importable]) -> list[Importable]:
        self.copied = True
        for c in cmds:
            if isinstance(c, Publish):
                self.nodes[c.node_id] = c.incarnation
        return cmds

    def clears(self) -> list[Importable]:
        """A snapshot after a partial copy: every imported node's entries of the shard
        cleared first (the snapshot holds what is left of them)."""
        if not self.copied:
            return []
        return [ClearNode(n, inc, None, False) for n, inc in sorted(self.nodes.items())]


def move(
    home: tuple[str, ...],
    security: ClientSecurity,
    fetch: Callable[[], ShardMap],
    shard_id: int,
    to: str,
    timeout_s: float,
    say: Callable[[str], None],
) -> ShardMap:
    """Run every step; the map as committed at the end."""
    mover = Mover(security, time.monotonic() + timeout_s, say)
    m = fetch()
    try:
        started = m.with_move_started(shard_id, to)
    except ShardMapError as e:
        raise OpsError(str(e)) from e
    s = next(x for x in m.shards if x.shard_id == shard_id)
    shard = Range(s.shard_id, s.lo, s.hi)
    source, target = m.group(s.group_id).replicas, m.group(to).replicas
    mover.set_map(home, m, started, fetch)
    mover.step(target, pb.MOVE_STEP_BEGIN_IMPORT, shard)
    mover.import_until_frozen(source, target, shard)
    mover.step(target, pb.MOVE_STEP_IMPORT_DONE, shard)
    done = started.with_move_done(shard_id)
    mover.set_map(home, started, done, fetch)
    removed = sum(mover.step(source, pb.MOVE_STEP_DROP, shard, p).removed for p in range(SHARDS))
    say(f"source dropped {removed} entries of shard {shard_id}")
    return done


__all__ = ["move"]


def _maybe_applied(e: grpc.RpcError) -> bool:
    """UNAVAILABLE without the replica's `kvdir-outcome: not-applied`: the call may
    have reached Raft before the connection broke (a replica killed mid-call)."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers = {item.key: item.value for item in e.trailing_metadata() or ()}
    outcome = trailers.get("kvdir-outcome", "")
    return (outcome.decode() if isinstance(outcome, bytes) else outcome) != "not-applied"
