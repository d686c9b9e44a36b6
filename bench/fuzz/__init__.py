"""Hostile-input testing against real daemons (`kvdir fuzz`; docs/security.md).

Only the parser lives here, so `kvdir` commands that never fuzz import none
of it (hypothesis is a dev dependency).
"""

from __future__ import annotations

import argparse
from typing import Any


def _cmd(args: argparse.Namespace) -> int:
    from bench.fuzz.run import cmd_fuzz

    return cmd_fuzz(args)


def add_parser(sub: Any) -> None:
    f = sub.add_parser("fuzz", help="hostile input against real daemons (docs/security.md)")
    f.add_argument("--cases", type=int, default=200, help="hypothesis examples per target")
    f.add_argument("--seed", type=int, default=None, help="make the run repeatable")
    f.add_argument("--out", default="", help="also write the report (markdown) here")
    f.add_argument(
        "--atheris-runs",
        type=int,
        default=0,
        help="also run each coverage-guided atheris target this many times (0: off)",
    )
    f.set_defaults(func=_cmd)
