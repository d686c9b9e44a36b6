"""The operator's side of the multi-group simulator: the initial map, one split, one move.

The steps are `kvdir/shard_move.py`'s, in its order, each a command proposed
through a group's replicas (the entry the server's DirectoryAdmin uses) and
retried as its `Mover.on_group` retries:

0. g0 commits the initial map (SetShardMap from version 0, as replicas started
   with `--shard-map-init` do); later, a split (`kvdir ctl shards split`).
1. g0's map: the shard moving to the target.
2. The target: BeginImport.
3. The source's Watch (the production `WatchService` of one source replica)
   from a snapshot: the shard's entries (`shard_import.snapshot_publishes`),
   then every later command cut down to it (`shard_import.within`), into the
   target's log as Import commands, in batches of `Plan.batch` (one ImportShard
   call each).
4. Once the snapshot is in, the source commits FreezeShard; the import goes on
   until the stream has passed the freeze's index; the target commits ImportDone.
5. g0's map: the shard owned by the target.
6. The source drops the shard: DropShard parts 0..255.

Each call goes to the group's replicas in turn until one answers: a replica
that is down or answers "not applied" (UNAVAILABLE) is skipped, an unknown
outcome (ABORTED) is retried, and a refusal stops the move, unless an unknown
outcome came first and the refusal shows that the first try applied (the map
is already the new one; ImportDone or a drop part refused when asked again).
After a round of every replica the mover pauses `RETRY_PAUSE_STEPS`.

Where this simulator goes beyond shard_move.py, so that a move under faults
can finish (the product stops a move whose Watch breaks; docs/sharding.md,
"Not done yet"):

- A broken Watch (its replica crashed, a cut-off) is opened again on the next
  source replica from the last index imported. When that replica's history
  no longer covers it and the stream starts with a snapshot, the target's
  partial copy is cleared first (an imported ClearNode of every agent, which
  the target applies to the shard's keys only), then the snapshot imported.
- A call whose replica dies before it answers counts as an unknown outcome
  (it may still commit), as shard_move.py now counts an UNAVAILABLE that the
  replica did not mark not-applied (`_maybe_applied`; it had retried as if
  nothing applied, and the move stopped when the retry was refused).
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Literal

from bench.sim.group import SimGroup
from bench.sim.shard_clients import nodes
from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.directory import codec, snapshot
from kvdir.directory.block_index import SHARDS
from kvdir.directory.commands import (
    BeginImport,
    ClearNode,
    Command,
    DropShard,
    FreezeShard,
    Import,
    ImportDone,
    Rejected,
    Result,
    SetShardMap,
)
from kvdir.directory.consensus.port import Outcome, WriteResult
from kvdir.directory.shard_admin import IMPORT_COMMANDS_MAX
from kvdir.directory.shard_fence import Range
from kvdir.directory.shard_import import Importable, snapshot_publishes, within
from kvdir.directory.shard_view import HOME_GROUP
from kvdir.directory.watch import WatchService
from kvdir.directory.watch_hub import CutOff, Refused, Watcher
from kvdir.v1 import directory_pb2 as pb

WRITE_TIMEOUT_S = 3.0
"""Simulated seconds one proposal may take before its outcome counts unknown (the
server's is 10 s; shorter keeps a seed's run short)."""
RETRY_PAUSE_STEPS = 20
"""shard_move.RETRY_PAUSE_S (0.2 s) in 10 ms steps."""
REOPEN_PAUSE_STEPS = 10
EVENTS_PER_STEP_MAX = 64

Wait = Generator[None, None, None]
Kind = Literal["ok", "unknown", "unavailable", "refused"]


@dataclass(frozen=True, slots=True)
class Answer:
    kind: Kind
    result: Result | None = None
    index: int = 0
    """For "ok": the index the command was applied at, on the replica that answered."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Sabotage:
    """Tests only: a mover that breaks the protocol, so the checks must fail."""

    skip_freeze: bool = False
    """Never freeze the source: the import stops at its first event after the snapshot,
    and writes the source still takes are lost at the handover."""
    skip_later_commands: bool = False
    """Import the snapshot only, not the commands that follow it."""
    skip_drop: bool = False
    """Leave the moved shard's entries on the source."""
    hold_steps: int = 0
    """Wait this long between the end of the import and ImportDone."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the operator does, and when (drawn from the seed)."""

    groups: tuple[Group, ...]
    split_at: int
    split_shard: int
    new_shard: int
    move_at: int
    """Steps after the split committed."""
    move_shard: int
    target: str
    batch: int
    """Commands per ImportShard call."""

    @classmethod
    def draw(cls, rng: random.Random, groups: tuple[Group, ...]) -> Plan:
        first = even_map(groups)
        split = rng.choice(first.shards)
        new = max(s.shard_id for s in first.shards) + 1
        halves = [split.shard_id, new]
        moved = rng.choice([*halves, *(s.shard_id for s in first.shards)])
        owner = split.group_id if moved in halves else first.shards[moved].group_id
        target = rng.choice([g.group_id for g in groups if g.group_id != owner])
        return cls(
            groups,
            split_at=rng.randint(30, 250),
            split_shard=split.shard_id,
            new_shard=new,
            move_at=rng.randint(20, 300),
            move_shard=moved,
            target=target,
            batch=rng.choice([1, 8, IMPORT_COMMANDS_MAX]),
        )

    def first(self) -> ShardMap:
        return even_map(self.groups)

    def final(self) -> ShardMap:
        """The map the run ends with (when the move finished)."""
        split = self.first().with_split(self.split_shard, self.new_shard)
        return split.with_move_started(self.move_shard, self.target).with_move_done(self.move_shard)


@dataclass
class _Stream:
    address: str
    incarnation: int
    service: WatchService
    watcher: Watcher
    first: Iterator[pb.WatchEvent]


class Mover:
    """The operator, advanced one step at a time (`step`): a generator that yields
    whenever it waits for simulated time to pass."""

    def __init__(
        self,
        groups: dict[str, SimGroup],
        plan: Plan,
        note: Callable[[str], None],
        violation: Callable[[str, str], None],
        sabotage: Sabotage | None = None,
    ) -> None:
        self.groups = groups
        self.plan = plan
        self._note, self._violation = note, violation
        self.sabotage = sabotage or Sabotage()
        self.stage = "starting"
        self.finished = False
        self.failed = ""
        self.reopens = 0
        self.clears = 0
        self.imported = 0
        self.dropped = 0
        self._run = self._operate()

    @property
    def busy(self) -> bool:
        return not (self.finished or self.failed)

    def note(self, text: str) -> None:
        self._note(f"mover: {text}")

    def step(self) -> None:
        if not self.busy:
            return
        with contextlib.suppress(StopIteration):  # the last step ends the generator
            next(self._run)

    def _fail(self, what: str) -> None:
        self.failed = what
        self._violation("move_failed", f"{self.stage}: {what}"[:300])

    # ------------------------------------------------------------ the steps

    def _operate(self) -> Wait:
        p = self.plan
        self.stage = "initial map"
        first = p.first()
        if not (yield from self._set_map(None, first)):
            return
        yield from self._wait(p.split_at)
        self.stage = "split"
        split = first.with_split(p.split_shard, p.new_shard)
        if not (yield from self._set_map(first, split)):
            return
        yield from self._wait(p.move_at)
        self.stage = "move: map moving"
        started = split.with_move_started(p.move_shard, p.target)
        if not (yield from self._set_map(split, started)):
            return
        s = next(x for x in split.shards if x.shard_id == p.move_shard)
        shard = Range(s.shard_id, s.lo, s.hi)
        source, target = self.groups[s.group_id], self.groups[p.target]
        self.note(f"moves shard {s.shard_id} from {source.gid} to {target.gid}")
        self.stage = "move: BeginImport"
        begin = BeginImport(shard.shard_id, shard.lo, shard.hi)
        if (yield from self._step(target, begin)) is None:
            return
        self.stage = "move: import"
        if not (yield from self._import_until_frozen(source, target, shard)):
            return
        yield from self._wait(self.sabotage.hold_steps)
        self.stage = "move: ImportDone"
        if (yield from self._step(target, ImportDone(shard.shard_id), again_refused=True)) is None:
            return
        self.stage = "move: map done"
        done = started.with_move_done(p.move_shard)
        if not (yield from self._set_map(started, done)):
            return
        self.stage = "move: drop"
        for part in range(0 if not self.sabotage.skip_drop else SHARDS, SHARDS):
            if (yield from self._step(source, DropShard(shard.shard_id, part), True)) is None:
                return
        self.note(f"source {source.gid} dropped {self.dropped} entries of shard {s.shard_id}")
        self.stage = "finished"
        self.finished = True

    def _wait(self, steps: int) -> Wait:
        for _ in range(steps):
            yield

    def _set_map(self, old: ShardMap | None, new: ShardMap) -> Generator[None, None, bool]:
        home = self.groups[HOME_GROUP]

        def settled(addr: str) -> bool:  # shard_move: `fetch() == new`
            r = home.seats[addr].replica
            return r is not None and r.table.shard_map == new

        cmd = SetShardMap(0 if old is None else old.version, new)
        ans = yield from self._on_group(home, f"shard map v{new.version}", self._one(cmd), settled)
        if ans is not None:
            self.note(f"shard map v{new.version} committed")
        return ans is not None

    def _step(
        self, group: SimGroup, cmd: Command, again_refused: bool = False
    ) -> Generator[None, None, Answer | None]:
        """One MoveShard step. ImportDone and a drop part are refused when asked again
        once applied: after an unknown outcome that refusal means the first try did it."""
        ans = yield from self._on_group(
            group,
            type(cmd).__name__,
            self._one(cmd),
            (lambda _addr: True) if again_refused else None,
        )
        if ans is not None and isinstance(cmd, DropShard):
            self.dropped += int(getattr(ans.result, "removed", 0))
        if ans is not None and not isinstance(cmd, DropShard):
            self.note(f"{group.gid} {type(cmd).__name__} applied (index {ans.index})")
        return ans

    # ------------------------------------------------------------ calls

    def _one(self, cmd: Command) -> Callable[[SimGroup, str], Generator[None, None, Answer]]:
        def call(group: SimGroup, addr: str) -> Generator[None, None, Answer]:
            return self._propose(group, addr, cmd)

        return call

    def _on_group(
        self,
        group: SimGroup,
        what: str,
        call: Callable[[SimGroup, str], Generator[None, None, Answer]],
        settled: Callable[[str], bool] | None = None,
    ) -> Generator[None, None, Answer | None]:
        """shard_move.Mover.on_group over the simulated replicas (the module docstring)."""
        unknown = False
        while True:
            for addr in group.addresses:
                if not group.seats[addr].up:
                    continue  # UNAVAILABLE: the next replica
                ans = yield from call(group, addr)
                if ans.kind == "ok":
                    return ans
                if ans.kind == "unknown":
                    unknown = True
                elif ans.kind == "refused":
                    if unknown and settled is not None and settled(addr):
                        self.note(f"{what}: refused again at {addr}; the first try applied")
                        return ans
                    self._fail(f"{what}: {group.gid} {addr}: {ans.detail}")
                    return None
            yield from self._wait(RETRY_PAUSE_STEPS)

    def _propose(self, group: SimGroup, addr: str, cmd: Command) -> Generator[None, None, Answer]:
        box: list[tuple[WriteResult, int]] = []
        incarnation = group.seats[addr].incarnation
        group.propose(addr, cmd, lambda res, index: box.append((res, index)))
        deadline = group.clock.now + WRITE_TIMEOUT_S
        while not box:
            if not group.alive(addr, incarnation):
                return Answer("unknown", detail="the replica died before it answered")
            if group.clock.now >= deadline:
                return Answer("unknown", detail="no answer in time")
            yield
        res, index = box[0]
        if res.outcome is Outcome.NOT_APPLIED:
            return Answer("unavailable", detail=res.reason)
        if res.outcome is Outcome.UNKNOWN:
            return Answer("unknown", detail=res.reason)
        if isinstance(res.result, Rejected):
            return Answer("refused", res.result, index, res.result.message)
        return Answer("ok", res.result, index)

    # ------------------------------------------------------------ the import

    def _send(
        self, target: SimGroup, shard: Range, cmds: list[Importable]
    ) -> Generator[None, None, bool]:
        """ImportShard calls of `Plan.batch` commands; a failed call is sent again whole."""
        size = self.plan.batch
        for i in range(0, len(cmds), size):
            batch = [Import(shard.shard_id, c) for c in cmds[i : i + size]]

            def call(
                group: SimGroup, addr: str, batch: list[Import] = batch
            ) -> Generator[None, None, Answer]:
                ans = Answer("ok")
                for cmd in batch:  # the server proposes them in order, each awaited
                    ans = yield from self._propose(group, addr, cmd)
                    if ans.kind != "ok":
                        return ans
                return ans

            if (yield from self._on_group(target, "ImportShard", call)) is None:
                return False
            self.imported += len(batch)
        return True

    def _import_until_frozen(
        self, source: SimGroup, target: SimGroup, shard: Range
    ) -> Generator[None, None, bool]:
        """Steps 3 and 4: the source's Watch into the target, the freeze in between."""
        frozen_at: int | None = None
        last = 0
        """The source's last index whose commands are imported."""
        have_copy = False
        after = ""
        while True:
            stream = yield from self._open(source, last, after)
            after = stream.address
            chunks: list[bytes] = []
            read = 0
            while True:
                if read >= EVENTS_PER_STEP_MAX:
                    read = 0
                    yield  # the rest comes next step
                    continue
                ev = self._next(source, stream)
                if ev is None:
                    break
                read += 1
                kind = ev.WhichOneof("event")
                if kind == "snapshot":
                    chunks.append(ev.snapshot.data)
                    if not ev.snapshot.last:
                        continue
                    table, _, _ = snapshot.load(io.BytesIO(b"".join(chunks)), "source snapshot")
                    chunks = []
                    cmds: list[Importable] = []
                    if have_copy:  # the target holds an older partial copy: it goes first
                        self.clears += 1
                        cmds = [ClearNode(n, inc, None, False) for n, inc in nodes()]
                    cmds += list(snapshot_publishes(table, shard))
                    if not (yield from self._send(target, shard, cmds)):
                        return False
                    have_copy = True
                    last = ev.snapshot.index
                    self.note(f"imported {stream.address}'s snapshot at index {last}")
                    continue
                if kind == "entries":
                    new = [
                        within(codec.decode(blob), shard)
                        for index, blob in zip(ev.entries.indexes, ev.entries.commands, strict=True)
                        if index > last
                    ]
                    cut = [c for c in new if c is not None]
                    send = cut and not self.sabotage.skip_later_commands
                    if send and not (yield from self._send(target, shard, cut)):
                        return False
                last = max(last, ev.applied_index)
                if frozen_at is None:
                    if self.sabotage.skip_freeze:
                        frozen_at = last
                    else:
                        freeze = FreezeShard(shard.shard_id, shard.lo, shard.hi)
                        self.stage = "move: freeze"
                        ans = yield from self._step(source, freeze)
                        if ans is None:
                            return False
                        frozen_at = ans.index
                        self.stage = "move: import"
                        self.note(f"source {source.gid} frozen at index {frozen_at}")
                if last >= frozen_at:
                    stream.service.hub.close(stream.watcher)
                    return True
                if kind == "heartbeat":
                    read = EVENTS_PER_STEP_MAX  # nothing more queued now

    def _open(self, source: SimGroup, last: int, after: str) -> Generator[None, None, _Stream]:
        """A Watch on the next running source replica (after `after`) from `last`."""
        order = source.addresses
        i = order.index(after) + 1 if after else 0
        while True:
            addr = order[i % len(order)]
            i += 1
            seat = source.seats[addr]
            held = source.watch.get(addr)
            if seat.up and held is not None and held[0] == seat.incarnation:
                try:
                    w, first = held[1].open(pb.WatchRequest(from_index=last))
                except Refused as e:
                    self.note(f"{addr} refuses a watch from {last}: {e.reason}")
                else:
                    if after:
                        self.reopens += 1
                    self.note(f"follows {source.gid} {addr} from index {last}")
                    return _Stream(addr, seat.incarnation, held[1], w, first)
            yield from self._wait(REOPEN_PAUSE_STEPS)

    def _next(self, source: SimGroup, s: _Stream) -> pb.WatchEvent | None:
        """The stream's next event (a heartbeat when nothing is queued); None: it ended."""
        if not source.alive(s.address, s.incarnation):
            self.note(f"lost its watch on {s.address} (the replica is gone)")
            return None
        ev = next(s.first, None)
        if ev is not None:
            return ev
        # Commands queued, or a heartbeat at once (the stream's is every 50 ms; a step
        # is 10 ms): the freeze waits for the first event after the snapshot.
        item = s.service.next_event(s.watcher, 0.0)
        if isinstance(item, CutOff):
            self.note(f"cut off by {s.address}: {item.reason}")
            return None
        return item


__all__ = ["Mover", "Plan", "Sabotage"]
