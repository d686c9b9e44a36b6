"""The routing cost model: what a prefix hit saves and what a pull costs, in seconds.

Pure arithmetic, no I/O. Defaults are the H200 figures of ../shared/MISSION.md
(docs/routing.md records where each one comes from):

- prefill time of `n` tokens is fitted as `a*n + b*n^2` (attention makes it
  super-linear) through the measured prefill times of the model shape, so
  recomputing tokens `[s, e)` costs `T(e) - T(s)`;
- a pull of `k` blocks over a transport costs `setup_s + bytes / bandwidth`,
  with `bytes = k * block_tokens * kv_bytes_per_token`.

Pull versus recompute is decided by comparing those two numbers, never by a
fixed threshold: a pull is chosen only when it is strictly faster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

KIB = 1024
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """Prefill seconds of `n` tokens as `linear_s * n + quadratic_s * n^2`."""

    linear_s: float
    quadratic_s: float

    def __post_init__(self) -> None:
        assert self.linear_s >= 0 and self.quadratic_s >= 0, self

    def seconds(self, tokens: int) -> float:
        assert tokens >= 0, tokens
        return self.linear_s * tokens + self.quadratic_s * tokens * tokens

    def recompute_s(self, start_tokens: int, end_tokens: int) -> float:
        """Seconds to prefill tokens `[start, end)` given `[0, start)` already in KV."""
        assert 0 <= start_tokens <= end_tokens, (start_tokens, end_tokens)
        return self.seconds(end_tokens) - self.seconds(start_tokens)


def fit_prefill(points: Sequence[tuple[int, float]]) -> PrefillFit:
    """Least-squares fit of `a*n + b*n^2` (through the origin) to (tokens, seconds) points.

    A fit whose quadratic term comes out negative (noise on nearly linear data)
    falls back to the best linear fit, so recompute time never shrinks with length.
    """
    assert points and all(n > 0 and s > 0 for n, s in points), points
    s11 = sum(float(n) ** 2 for n, _ in points)
    s12 = sum(float(n) ** 3 for n, _ in points)
    s22 = sum(float(n) ** 4 for n, _ in points)
    r1 = sum(n * s for n, s in points)
    r2 = sum(float(n) ** 2 * s for n, s in points)
    det = s11 * s22 - s12 * s12
    if len(points) >= 2 and det > 0:
        a = (r1 * s22 - r2 * s12) / det
        b = (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= 0:
            return PrefillFit(a, b)
    return PrefillFit(r1 / s11, 0.0)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model shape: KV bytes per token and measured prefill times on one GPU."""

    name: str
    kv_bytes_per_token: int
    prefill_points: tuple[tuple[int, float], ...]
    """(tokens, seconds) measurements the prefill fit goes through."""

    def prefill(self) -> PrefillFit:
        return fit_prefill(self.prefill_points)


LLAMA3_8B = ModelShape(
    "llama-3-8b",
    128 * KIB,
    ((1_000, 0.031), (4_000, 0.119), (8_000, 0.260)),
)
"""MISSION.md, one H200, bf16: 31 / 119 / 260 ms for 1k / 4k / 8k tokens; 128 KiB/token."""

LLAMA_70B = ModelShape(
    "llama-70b",
    320 * KIB,
    ((4_000, 0.970), (8_000, 2.030)),
)
"""MISSION.md, one H200, 80 layers: ~970 / ~2,030 ms for 4k / 8k tokens; 320 KiB/token."""

SHAPES: Mapping[str, ModelShape] = MappingProxyType({s.name: s for s in (LLAMA3_8B, LLAMA_70B)})


@dataclass(frozen=True, slots=True)
class Link:
    """One transport's cost: a fixed setup time plus bytes over a bandwidth."""

    bandwidth_bytes_per_s: float
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.bandwidth_bytes_per_s > 0 and self.setup_s >= 0, self

    def transfer_s(self, nbytes: int) -> float:
        return self.setup_s + nbytes / self.bandwidth_bytes_per_s


DEFAULT_LINKS: Mapping[str, Link] = MappingProxyType(
    {
        # Same host: CUDA IPC reads at ~2 TB/s and device-to-device copies at
        # 1.5-1.9 TB/s; take the low end, plus 0.65 ms to open the IPC handle.
        "shm": Link(1.5e12, 0.65e-3),
        # 400 Gbit/s RoCE line rate = 50 GB/s (128 MB in ~2.7 ms; the seed
        # measured 2.85 ms).
        "rdma": Link(50e9, 0.0),
        # 128 MiB GPU->pinned host, one Python TCP stream, host->GPU: 46.8 ms.
        "tcp": Link(128 * MIB / 46.8e-3, 0.0),
    }
)

LOAD_UNIT_S_DEFAULT = 0.119
"""Seconds of penalty per unit of load: one queued request ~ one 4k-token 8B prefill."""


@dataclass(frozen=True, slots=True)
class PullPlan:
    """The cheaper way to get blocks `[local_blocks, peer_blocks)` onto a node."""

    pull: bool
    blocks: int
    """Blocks the plan concerns (`peer_blocks - local_blocks`)."""
    recompute_s: float
    transfer_s: float

    @property
    def saved_s(self) -> float:
        """Prefill seconds the pull saves (0 when recomputing is at least as fast)."""
        return self.recompute_s - self.transfer_s if self.pull else 0.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill speed, KV size and per-transport links of one model namespace."""

    block_tokens: int
    shape: ModelShape = LLAMA3_8B
    links: Mapping[str, Link] = field(default_factory=lambda: DEFAULT_LINKS)
    load_unit_s: float = LOAD_UNIT_S_DEFAULT
    prefill: PrefillFit = field(init=False)

    def __post_init__(self) -> None:
        assert self.block_tokens > 0 and self.load_unit_s >= 0, self
        object.__setattr__(self, "prefill", self.shape.prefill())

    def block_bytes(self) -> int:
        return self.block_tokens * self.shape.kv_bytes_per_token

    def local_saved_s(self, blocks: int) -> float:
        """Prefill seconds saved by `blocks` leading blocks already on the node."""
        return self.prefill.seconds(blocks * self.block_tokens)

    def transfer_s(self, transport: str, blocks: int) -> float:
        return self.links[transport].transfer_s(blocks * self.block_bytes())

    def pull_plan(self, transport: str, local_blocks: int, peer_blocks: int) -> PullPlan:
        """Pull `[local, peer)` over `transport` only if that beats recomputing it."""
        assert 0 <= local_blocks <= peer_blocks, (local_blocks, peer_blocks)
        n = peer_blocks - local_blocks
        tokens = self.block_tokens
        recompute = self.prefill.recompute_s(local_blocks * tokens, peer_blocks * tokens)
        transfer = self.transfer_s(transport, n)
        return PullPlan(n > 0 and transfer < recompute, n, recompute, transfer)

    def load_penalty_s(self, load: float) -> float:
        return self.load_unit_s * load
