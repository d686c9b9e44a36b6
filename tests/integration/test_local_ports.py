"""The harness's port picks and its one-line "exited" message (kvdir/local.py)."""

from __future__ import annotations

import socket
from pathlib import Path

from kvdir.local import _ephemeral_range, exited, free_port_run, free_ports


def test_picked_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    lo, hi = _ephemeral_range()
    ports = free_ports(20) + free_ports(20)
    assert len(set(ports)) == len(ports)  # one process never hands a port out twice
    assert all(not lo <= p <= hi for p in ports), (lo, hi, ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped() -> None:
    (first,) = free_ports(1)
    # The cursor walks upwards: take the next few ports the way a child process would.
    held = []
    for p in range(first + 1, first + 4):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            s.close()
            continue
        s.listen()
        held.append(s)
    try:
        got = free_ports(3)
        assert not {s.getsockname()[1] for s in held} & set(got)
    finally:
        for s in held:
            s.close()


def test_a_run_is_consecutive_and_not_handed_out_again() -> None:
    base = free_port_run(5)
    run = set(range(base, base + 5))
    assert not run & set(free_ports(10))


def test_exited_names_the_last_lines_of_the_log_on_one_line(tmp_path: Path) -> None:
    log = tmp_path / "replica.log"
    log.write_text("started\n\nTraceback (most recent call last):\n  File x\nOSError: in use\n")
    msg = exited("replica r2", 1, log)
    assert "\n" not in msg
    assert msg.startswith("replica r2 exited with 1") and msg.endswith("OSError: in use"), msg
    assert "(no log:" in exited("agent a", 1, tmp_path / "missing.log")
