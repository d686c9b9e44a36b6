"""How long a Raft journal's fdatasync waits while a compaction dump is made durable.

Run as ``python -m bench.dump_sync_stall --mb 190``. One thread stands in for
the Raft thread's journal: it appends 200 bytes to a file and fdatasyncs it,
every 2 ms. Meanwhile another writes a dump of `--mb` MiB next to it (1 MiB
writes) and makes it durable in one of two ways:

- ``at-end``: every byte written, then one fsync (the dump writer before
  78e1861);
- ``every``: an fdatasync after every `kvdir.directory.snapshot.DUMP_SYNC_BYTES`
  written, then the final fsync (`snapshot.write` now).

Then the dump is replaced by a small file, as the next compaction (or a
journal rewrite) replaces it, in one of two ways:

- ``replace``: `replace_durably` (the dump and the journal rewrite before):
  the rename frees the old file's blocks in the caller;
- ``replace-later``: `replace_freeing_later` (now): held open across the
  rename, truncated and closed by another thread, a step at a time.

Reported per mode and run: the longest and the p99 journal fdatasync while the
dump was written and synced (or replaced), and how long the caller took. On ext4 (data=ordered) a
journal commit first writes out the data blocks allocated in its transaction,
other files' included, so the dump's writeback lands on the journal's sync.
A journal sync longer than the election timeout (150 ms) on a leader is an
election. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

from kvdir.directory.consensus.sync import replace_durably, replace_freeing_later
from kvdir.directory.snapshot import DUMP_SYNC_BYTES

JOURNAL_RECORD_BYTES = 200
JOURNAL_PERIOD_S = 0.002
WRITE_BYTES = 1 << 20


def _journal(path: str, stop: threading.Event, syncs: list[float]) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while not stop.is_set():
            t = time.perf_counter()
            os.write(fd, b"j" * JOURNAL_RECORD_BYTES)
            os.fdatasync(fd)
            syncs.append(time.perf_counter() - t)
            stop.wait(JOURNAL_PERIOD_S)
    finally:
        os.close(fd)


def _dump(path: str, mb: int, every: int | None) -> None:
    buf = os.urandom(WRITE_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        unsynced = 0
        for _ in range(mb):
            os.write(fd, buf)
            unsynced += WRITE_BYTES
            if every is not None and unsynced >= every:
                os.fdatasync(fd)
                unsynced = 0
        os.fsync(fd)
    finally:
        os.close(fd)


def run_once(d: str, mb: int, mode: str) -> dict[str, Any]:
    syncs: list[float] = []
    stop = threading.Event()
    journal = threading.Thread(target=_journal, args=(os.path.join(d, "journal"), stop, syncs))
    journal.start()
    while not syncs:  # the journal is syncing before the dump starts
        time.sleep(JOURNAL_PERIOD_S)
    dump = os.path.join(d, "dump")
    if mode.startswith("replace"):
        _dump(dump, mb, DUMP_SYNC_BYTES)
        with open(dump + ".new", "wb") as f:
            f.write(b"new")
    first = len(syncs)
    t0 = time.perf_counter()
    if mode == "replace":
        replace_durably(dump + ".new", dump)
    elif mode == "replace-later":
        replace_freeing_later(dump + ".new", dump)
    else:
        _dump(dump, mb, DUMP_SYNC_BYTES if mode == "every" else None)
    call_s = time.perf_counter() - t0
    stop.wait(0.5)  # the journal keeps syncing while a freeing thread may still run
    stop.set()
    journal.join()
    during = sorted(syncs[first:])
    os.unlink(dump)
    return {
        "mode": mode,
        "call_s": round(call_s, 3),
        "journal_syncs": len(during),
        "journal_sync_max_ms": round(during[-1] * 1e3, 1) if during else None,
        "journal_sync_p99_ms": round(during[int(0.99 * (len(during) - 1))] * 1e3, 1)
        if during
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dump_sync_stall", description=__doc__)
    p.add_argument("--mb", type=int, default=190, help="dump size in MiB (3M entries: ~190)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    a = p.parse_args(argv)
    if not 1 <= a.mb <= 4096 or not 1 <= a.runs <= 20:
        p.error("--mb 1..4096, --runs 1..20")
    with tempfile.TemporaryDirectory(prefix="kvdir-dump-sync-", dir=a.dir) as d:
        results = [
            {"run": i + 1, **run_once(d, a.mb, mode)}
            for i in range(a.runs)
            for mode in ("at-end", "every", "replace", "replace-later")
        ]
    out = {
        "mb": a.mb,
        "dump_sync_bytes": DUMP_SYNC_BYTES,
        "load_average": list(os.getloadavg()),
        "results": results,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
