"""Who holds a reserved slot: an engine process, named so that a reused pid is not it.

An owner is (pid, start ticks): the process id and its start time in clock
ticks since boot (field 22 of /proc/<pid>/stat). A pid the kernel recycled
for another process has another start time, so a dead engine is never taken
for alive, and a live one is never taken for dead. The agent records the
owner in each slot header it hands out (agent/pool.py) and reclaims the slots
of owners that are gone.

Engine and agent must share a pid namespace (one host, no pid-isolating
container between them): a pid the agent cannot see gets NO_OWNER, whose
slots are never reclaimed (a leak, never wrong KV).
"""

from __future__ import annotations

from typing import NamedTuple


class Owner(NamedTuple):
    pid: int
    start_ticks: int


NO_OWNER = Owner(0, 0)


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot; 0 when it is not visible."""
    if pid <= 0:
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: fields after
    # the last ')' are fixed. starttime is field 22, the 20th after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def owner_of(pid: int) -> Owner:
    """The owner to record for a caller that says it is `pid` (NO_OWNER if not visible)."""
    ticks = start_ticks(pid)
    return Owner(pid, ticks) if ticks else NO_OWNER


def alive(owner: Owner) -> bool:
    """Whether the process is still running (a zombie counts as gone: it writes nothing)."""
    if owner == NO_OWNER:
        return True
    if start_ticks(owner.pid) != owner.start_ticks:
        return False
    try:
        with open(f"/proc/{owner.pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 :][:1]
    return state not in (b"Z", b"X")
