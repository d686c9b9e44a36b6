"""The N slowest tests of one or more pytest JUnit XML files (setup + call + teardown).

    python scripts/slowest.py N FILE.xml [FILE.xml ...]

`make test` runs the suite as two concurrent pytest runs (scripts/run-tests.sh); this
prints one list for both, as `pytest --durations=N` would for one run. A missing or
unreadable file (a run that died before writing it) is named, not fatal.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def cases(path: str) -> list[tuple[float, str]]:
    """(seconds, node id) for each test case in `path`."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out.append((float(case.get("time") or 0.0), name))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    n = int(argv[0])
    found: list[tuple[float, str]] = []
    for path in argv[1:]:
        try:
            found += cases(path)
        except (OSError, ET.ParseError) as e:
            print(f"slowest: {path}: {e}", file=sys.stderr)
    print(f"==> the {n} slowest tests (setup + call + teardown) of {len(found)}")
    for seconds, name in sorted(found, reverse=True)[:n]:
        print(f"{seconds:9.2f}s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
