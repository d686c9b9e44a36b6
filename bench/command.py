"""What every `kvdir bench NAME` subcommand shares: its parser and the common options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_command(
    kinds: Any,
    name: str,
    help_text: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """`kvdir bench NAME`: its description is `doc` up to its package map."""
    p = kinds.add_parser(
        name,
        help=help_text,
        description=doc.split("\n\nPackage map", 1)[0] if doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_quick_and_out_dir(p: argparse.ArgumentParser, stem: str) -> None:
    """--quick (a smoke run) and --out-dir (where STEM-DATE.{md,json} go)."""
    p.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke run (about a minute)"
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help=f"where to write {stem}-DATE.{{md,json}} (default bench/results)",
    )
