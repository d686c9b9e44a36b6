"""Phase: the table's bytes per entry, measured in a fresh process (bench/memory.py).

A separate process so that nothing else this benchmark allocated counts; it
runs after the cluster stopped. (The replicas' own RSS growth is recorded by
the publish phase.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from bench.measure import say

ENTRIES_PER_S_MIN = 20_000
"""The subprocess's timeout grows with the entries at this slowest acceptable rate."""
TIMEOUT_S_MIN = 600.0


def table_memory(entries: int) -> dict[str, Any]:
    say(f"table memory at {entries:,} entries (separate process)")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--entries", str(entries)],
        capture_output=True,
        text=True,
        timeout=max(TIMEOUT_S_MIN, entries / ENTRIES_PER_S_MIN),
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement failed: {proc.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    say(f"  {out['bytes_per_entry']:.1f} bytes per entry")
    return out


def run(results: dict[str, Any], entries: int, skip: bool) -> None:
    """Into results['memory']['table']: the measurement, or {'skipped': True}."""
    mem = results.setdefault("memory", {})
    mem["table"] = {"skipped": True} if skip else table_memory(entries)
