"""Bounds shared by the agent daemon and the engine side (one home each).

The engine side (agent/engine/) imports these, never the daemon's modules.
"""

from __future__ import annotations

CHAIN_BLOCKS_MAX = 4096
"""Blocks in one chain an engine may look up or fetch (longer prompts load their first part)."""

HOLDERS_TRIED_MAX = 3
"""Holders one fetch tries, best first (the next one after a failed transfer)."""

TICKET_HOLDERS_MAX = HOLDERS_TRIED_MAX
"""Holders a load ticket carries: as many as a fetch would try."""

RECORD_BYTES = 8 + 4 + 4 + 8 + 1
"""One block's record in a ticket: address u64, length u32, rkey u32, generation u64, tier u8."""

TICKET_MAC_BYTES = 16
TICKET_HOLDER_FIXED_BYTES_MAX = 1024
"""A holder's node id, host, endpoint, transports and field tags (generously)."""

TICKET_BYTES_MAX = (
    TICKET_HOLDERS_MAX * (CHAIN_BLOCKS_MAX * RECORD_BYTES + TICKET_HOLDER_FIXED_BYTES_MAX)
    + 1024
    + TICKET_MAC_BYTES
)
"""A whole ticket (~300 KiB at the bounds above); larger is refused unread."""

assert TICKET_HOLDERS_MAX <= HOLDERS_TRIED_MAX, "a fetch never tries more holders than it has"
