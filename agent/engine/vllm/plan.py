"""Pure scheduler-side planning: how many tokens to load, which blocks to save.

No I/O, no clock, no vLLM: the scheduler adapter passes numbers in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdir.agent.limits import CHAIN_BLOCKS_MAX

RECENT_SAVES_MAX = 65_536
"""Hashes this engine saved lately, so a prefix shared in one batch is saved once."""
COST_WEIGHT = 0.25
"""Weight of a new sample in the pull-cost averages (about the last 4-8 samples count)."""
PREFILL_SAMPLE_TOKENS_MIN = 256
"""A step that computed fewer tokens says little about prefill speed (overheads dominate)."""


@dataclass(frozen=True, slots=True)
class Found:
    """What one lookup found for a request's chain, from block 0."""

    pool_slots: tuple[int, ...] = ()
    """Slots of this node's pool holding the leading blocks."""
    peer_blocks: int = 0
    """The longest prefix any peer holds."""
    answered: bool = False
    """False when the agent or the directory did not answer in time (nothing loads)."""
    ticket: bytes = b""
    """The agent's load ticket for the peer part (opaque; its Fetch reads on it
    without a second directory lookup). Empty: no peer holds more than the pool."""
    path: str = ""
    """The path the ticket's best holder is read over (agent/holders.py), "" without one."""

    @property
    def pool_blocks(self) -> int:
        return len(self.pool_slots)


NOTHING = Found()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    tokens: int
    """External tokens beyond the local hit (what get_num_new_matched_tokens returns)."""
    start_block: int
    end_block: int
    from_pool: int
    """Blocks of [start_block, end_block) this node's pool is expected to supply."""

    @property
    def peer_blocks(self) -> int:
        return self.end_block - self.start_block - self.from_pool


@dataclass(slots=True)
class PullCost:
    """Whether pulling a prefix from a peer beats recomputing it, from this engine's
    own measurements: seconds per byte of its peer loads (the whole load: lookup,
    transfer, copy into vLLM's blocks) and tokens per second of its prefill steps.
    Until both are measured a pull is always tried (and measured).

    The seed's point: 1 GB over loopback TCP takes longer than a 218 ms recompute
    on an H200, so such a pull is skipped; over CUDA IPC it wins by far."""

    load_s_per_byte: float = 0.0
    prefill_tokens_per_s: float = 0.0

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.load_s_per_byte = _ewma(self.load_s_per_byte, seconds / nbytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= PREFILL_SAMPLE_TOKENS_MIN and seconds > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, tokens / seconds)

    def pull_wins(self, nbytes: int, tokens: int) -> bool:
        if not (self.load_s_per_byte and self.prefill_tokens_per_s) or nbytes <= 0:
            return True
        return nbytes * self.load_s_per_byte < tokens / self.prefill_tokens_per_s


def _ewma(old: float, sample: float) -> float:
    return sample if old == 0.0 else (1 - COST_WEIGHT) * old + COST_WEIGHT * sample


def pool_only(plan: LoadPlan, block_tokens: int) -> LoadPlan:
    """`plan` without its peer part (what this node's pool supplies is always read)."""
    end = plan.start_block + plan.from_pool
    if plan.from_pool == 0:
        return LoadPlan(0, plan.start_block, plan.start_block, 0)
    cut = (plan.end_block - end) * block_tokens
    return LoadPlan(plan.tokens - cut, plan.start_block, end, plan.from_pool)


def loadable_blocks(num_hashes: int, num_tokens: int, block_tokens: int) -> int:
    """Leading full blocks of a request a load could bring: the block holding the
    prompt's last token is never loaded (vLLM computes at least that token to
    sample the next one)."""
    return min(num_hashes, max(0, num_tokens - 1) // block_tokens, CHAIN_BLOCKS_MAX)


def plan_load(
    found: Found,
    num_hashes: int,
    num_tokens: int,
    block_tokens: int,
    computed_tokens: int,
    min_blocks: int = 1,
) -> LoadPlan:
    """Full blocks to load after the `computed_tokens` vLLM has locally (block
    aligned), up to `loadable_blocks`."""
    start = computed_tokens // block_tokens
    cap = loadable_blocks(num_hashes, num_tokens, block_tokens)
    end = min(cap, max(found.pool_blocks, found.peer_blocks))
    if end - start < min_blocks:
        return LoadPlan(0, start, start, 0)
    from_pool = max(0, min(end, found.pool_blocks) - start)
    return LoadPlan(end * block_tokens - computed_tokens, start, end, from_pool)


@dataclass(slots=True)
class SaveCursor:
    """Per request: the first block not yet in (or on its way to) this node's pool."""

    next_block: int


@dataclass(slots=True)
class SavePlanner:
    """Which newly completed full blocks go to the pool, once each."""

    block_tokens: int
    cursors: dict[str, SaveCursor] = field(default_factory=dict)
    recent: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def admit(self, req_id: str, known_blocks: int) -> None:
        """A request starts with `known_blocks` leading blocks already in the pool."""
        self.cursors[req_id] = SaveCursor(known_blocks)

    def forget(self, req_id: str) -> None:
        self.cursors.pop(req_id, None)

    def due(self, req_id: str, hashes: Sequence[bytes], done_tokens: int) -> tuple[int, list[int]]:
        """(first block, indexes of blocks to save) once `done_tokens` are computed."""
        cur = self.cursors.get(req_id)
        if cur is None:
            return 0, []
        full = min(len(hashes), done_tokens // self.block_tokens)
        out = []
        for i in range(cur.next_block, full):
            h = hashes[i]
            if h in self.recent:
                self.recent.move_to_end(h)
                continue
            self.recent[h] = None
            out.append(i)
        while len(self.recent) > RECENT_SAVES_MAX:
            self.recent.popitem(last=False)
        first = cur.next_block
        cur.next_block = max(cur.next_block, full)
        return first, out


@dataclass(slots=True)
class BlockTables:
    """Each scheduled request's vLLM block ids, followed from the scheduler output.

    vLLM 0.24 gives a connector's scheduler side no other way to read a running
    request's block table: a new request arrives with its whole table, a
    cached one with the blocks appended this step (or, resumed after a
    preemption, its whole new table). Entries go at `forget` (request_finished).
    """

    tables: dict[str, list[int]] = field(default_factory=dict)

    def new(self, req_id: str, block_ids: Sequence[int]) -> None:
        self.tables[req_id] = list(block_ids)

    def cached(self, req_id: str, new_ids: Sequence[int] | None, resumed: bool) -> None:
        if new_ids is None:
            return
        table = self.tables.get(req_id)
        if resumed or table is None:
            self.tables[req_id] = list(new_ids)
        else:
            table.extend(new_ids)

    def get(self, req_id: str) -> list[int] | None:
        return self.tables.get(req_id)

    def forget(self, req_id: str) -> None:
        self.tables.pop(req_id, None)
