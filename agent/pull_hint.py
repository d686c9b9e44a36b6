"""The gateway's pull hint: which peer holds more of a request's prefix than this node.

`kvdir gateway` adds one header to a request it routes (docs/gateway.md)::

    X-Kvdir-Pull: peer=<node id>; local=<blocks>; blocks=<blocks>; transport=<name>

meaning: this node holds the first `local` blocks of the prompt's chain, and
`peer` holds blocks `[local, local + blocks)` as well, reachable over
`transport`; the router predicted that pulling them beats recomputing. The
engine-side integration hands it to its agent (`EngineClient.fetch` with the
prompt's chain) before prefill. The header is a hint: a peer that no longer
holds the blocks costs one failed fetch, then a normal prefill.

It lives in agent/ so that the agent side parses it without importing the
gateway (dependencies flow kvdir -> agent, never back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADER = "X-Kvdir-Pull"
ROUTE_HEADER = "X-Kvdir-Route"
"""Informational: node, policy, rule and predicted local blocks of the decision."""

_NODE_RE = re.compile(r"^[A-Za-z0-9._:/@+-]{1,256}$")
_TRANSPORT_RE = re.compile(r"^[a-z0-9_-]{1,32}$")


class HintError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PullHint:
    peer: str
    local_blocks: int
    blocks: int
    transport: str

    def __post_init__(self) -> None:
        if not _NODE_RE.match(self.peer):
            raise HintError(f"peer {self.peer!r} is not a node id")
        if not _TRANSPORT_RE.match(self.transport):
            raise HintError(f"transport {self.transport!r} is not a transport name")
        if self.local_blocks < 0 or self.blocks <= 0:
            raise HintError("local must be >= 0 and blocks > 0")

    def encode(self) -> str:
        return (
            f"peer={self.peer}; local={self.local_blocks}; blocks={self.blocks}; "
            f"transport={self.transport}"
        )


def parse(value: str) -> PullHint:
    """The hint in a header value; HintError with a reason when malformed."""
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, sep, v = part.strip().partition("=")
        if not sep or key in fields:
            raise HintError(f"{HEADER}: {part.strip()!r} is not a unique KEY=VALUE")
        fields[key] = v.strip()
    if set(fields) != {"peer", "local", "blocks", "transport"}:
        raise HintError(f"{HEADER} needs exactly peer, local, blocks and transport")
    if not (fields["local"].isdigit() and fields["blocks"].isdigit()):
        raise HintError(f"{HEADER}: local and blocks must be non-negative integers")
    return PullHint(
        fields["peer"], int(fields["local"]), int(fields["blocks"]), fields["transport"]
    )
