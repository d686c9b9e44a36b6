"""What a harness does about the processes it started when it is stopped.

A harness is anything that starts replicas, agents or engines and waits on them:
`kvdir demo`, `kvdir bench ...`, `kvdir fuzz`, and the test suite's fixtures.
Stopped by ^C or by SIGTERM alike, it ends everything it started:

- `interrupt_on_sigterm()`: SIGTERM raises KeyboardInterrupt in the main thread,
  as ^C does, so the `finally` blocks that stop replicas, agents and engines run
  whichever signal came. Python's default for SIGTERM is to die on the spot,
  leaving every child running.
- Children start in their own sessions (`start_new_session=True`), so a terminal's
  ^C reaches only the harness, which stops them in order; `stop_group()` ends a
  child's whole process group: vLLM's engine-core and worker processes are the
  driver's children and outlive it when only the driver is signalled.
- A backstop (Linux): `become_subreaper()` makes processes orphaned below the
  harness its children rather than init's, and `end_descendants()` ends every
  process still below it, e.g. one whose `Popen` a signal interrupted before it
  returned (the harness never learnt its pid).

Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

STOP_GRACE_S = 10.0
"""How long a process group has to exit after SIGTERM before it gets SIGKILL."""
KILL_WAIT_S = 10.0
"""How long SIGKILLed processes have to disappear (a hung one is reported, not waited on)."""
POLL_S = 0.05
"""How often a wait for processes to go looks again."""

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def interrupt_on_sigterm() -> None:
    """Handle SIGTERM as SIGINT: KeyboardInterrupt in the main thread.

    Only from the main thread (Python's rule for handlers), and only over the
    default disposition: a program that chose its own handler keeps it.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


def become_subreaper(on: bool = True) -> bool:
    """Adopt orphans below this process (Linux); False where the kernel cannot.

    Adopted orphans that exit stay zombies until this process exits (reaping them
    here would race `subprocess` for its own children's exit statuses): fine for a
    command, not for a long test session.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live (not zombie) process, from /proc."""
    out: dict[int, tuple[int, int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            out[int(d.name)] = (int(fields[1]), int(fields[2]))
    return out


def descendants(pid: int | None = None) -> set[int]:
    """Live processes below `pid` (default this one), children and their children."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, (parent, _) in _procs().items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that are still running (a zombie has ended)."""
    live = _procs()
    return {p for p in pids if p in live}


def group(pgid: int) -> set[int]:
    """Live members of process group `pgid`."""
    return {p for p, (_, g) in _procs().items() if g == pgid}


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = alive(left)
    return left


def _signal_all(pids: set[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _own_resource_tracker() -> set[int]:
    """multiprocessing's resource tracker of this process, if one runs.

    It ignores SIGTERM and SIGINT by design and exits by itself when this process
    does (its pipe closes), unlinking any shared memory left behind: waiting for it
    after a SIGTERM cost every stopped harness that used multiprocessing the whole
    grace (`kvdir bench directory --shards` took 12 s to end), and a SIGKILL would
    skip its clean-up. Read from multiprocessing's own record, not guessed."""
    from multiprocessing import resource_tracker

    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return {pid} if isinstance(pid, int) else set()


def end_descendants(grace_s: float = STOP_GRACE_S) -> set[int]:
    """SIGTERM every process below this one, SIGKILL what is left after `grace_s`.

    Returns the pids that were running when called (empty: nothing had leaked).
    """
    found = descendants() - _own_resource_tracker()
    if not found:
        return found
    _signal_all(found, signal.SIGTERM)
    left = _wait_gone(found, grace_s)
    if left:
        _signal_all(left | descendants(), signal.SIGKILL)
        _wait_gone(left, KILL_WAIT_S)
    return found


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """End `proc` (started with `start_new_session=True`) and everything in its group.

    SIGTERM to the group, SIGKILL after `grace_s`; the group's other members are
    ended even when the leader has already exited (vLLM's engine core outlives its
    driver). Reaps `proc`.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # The group's id stays reserved while any member lives, so these reach no stranger.
    members = group(proc.pid)
    if members:
        members = _wait_gone(members, grace_s)
    if members or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=KILL_WAIT_S)
    _wait_gone(group(proc.pid), KILL_WAIT_S)


@contextlib.contextmanager
def stopped_cleanly() -> Iterator[None]:
    """Run a harness: SIGTERM as ^C, and nothing it started left running after it.

    The `finally` blocks inside stop what they know of in order; this backstop then
    ends whatever is still below the process (orphans included, as their subreaper).
    """
    interrupt_on_sigterm()
    become_subreaper()
    try:
        yield
    finally:
        end_descendants()
