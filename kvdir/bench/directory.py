"""`kvdir bench directory` (being written)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser("directory", help="directory lookup/publish/failover benchmark")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not written yet")
