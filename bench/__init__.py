"""Tools, not the product: `kvdir bench|chaos|fuzz` from a source checkout.

Nothing here is installed by the wheel; the `kvdir` command finds this package
next to its own source (kvdir/cli.py) and says so in one line where it is absent.
`kvdir bench ...` benchmarks write their output under bench/results/.

A benchmark is not a test: it measures, compares against a baseline taken in
the same run (a ratio, since shared machines are noisy), and writes Markdown
and JSON with the machine, command and date.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results go under bench/results/)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from bench import directory

    directory.add_parser(kinds)
    from bench import transfer

    transfer.add_parser(kinds)
    from bench import events

    events.add_parser(kinds)
    from kvdir import replay

    replay.add_parser(kinds)
    from bench.gpu import cli as gpu

    gpu.add_parser(kinds)
    from bench import routing

    routing.add_parser(kinds)
    from bench import gateway

    gateway.add_parser(kinds)
    from bench import vllm

    vllm.add_parser(kinds)


__all__ = ["add_parsers", "argparse"]
