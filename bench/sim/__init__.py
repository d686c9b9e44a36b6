"""The seeded simulator of the real directory replicas (`kvdir sim`; issue 29).

- `disk`: the replicas' files, real, with a recording syncer; power loss
  rewinds a data dir to what was synced.
- `net`: pysyncobj's transport interface over a seeded message queue.
- `replicas`: real `_replica.Replica`s started, ticked and crashed by hand
  under a simulated clock.
- `workload`: Publish / Remove / linearizable Lookup clients and their history.
- `checks`: the invariants checked after every step.
- `simulation`: one seeded run; `run`: many seeds, the command line.
"""

from __future__ import annotations

import argparse
from typing import Any


def _cmd(args: argparse.Namespace) -> int:
    from bench.sim.run import cmd_sim

    return cmd_sim(args)


def add_parser(sub: Any) -> None:
    s = sub.add_parser("sim", help="the seeded simulator of the real Raft replicas (issue 29)")
    s.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    s.add_argument("--seed", type=int, default=1, help="the first seed")
    s.add_argument("--steps", type=int, default=1000, help="steps (10 ms of simulated time) each")
    s.add_argument("--replicas", type=int, default=3, choices=[3, 5])
    s.add_argument("--jobs", type=int, default=1, help="worker processes")
    s.add_argument("--max-seconds", type=float, default=0.0, help="stop after this (0: never)")
    s.add_argument("--trace", action="store_true", help="print a failing seed's whole trace")
    s.add_argument("--out", default="", help="also write the report (JSON) here")
    s.set_defaults(func=_cmd)
