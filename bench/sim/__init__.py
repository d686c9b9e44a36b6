"""The seeded simulator of the real directory replicas (`kvdir sim`; issue 29).

- `disk`: the replicas' files, real, with a recording syncer; power loss
  rewinds a data dir to what was synced.
- `net`: pysyncobj's transport interface over a seeded message queue.
- `replicas`: real `_replica.Replica`s started, ticked and crashed by hand
  under a simulated clock.
- `workload`: Publish / Remove / linearizable Lookup clients and their history.
- `mirrors`: a real `Mirror` fed by the replicas' real Watch services.
- `checks`: the invariants checked after every step.
- `knobs`: a seed's rates and a run's result; `cluster`: what the parts below
  see of a run; `faults`, `membership`: what a seed injects; `ending`: healing
  and the history's checks.
- `simulation`: one seeded run; `run`: many seeds, the command line;
- `groups`: one seeded run of several groups with a split and a move (issue
  31), over `group` (one group on a shared clock), `shard_clients` (clients
  routed by map), `mover` (the move protocol's steps) and `shard_checks`;
  `report`: a run's JSON and the markdown of merged runs.
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
    s.add_argument(
        "--groups",
        type=int,
        default=1,
        help="Raft groups of 3 replicas (2 or more: a split and a move under faults, `groups`)",
    )
    s.add_argument("--jobs", type=int, default=1, help="worker processes")
    s.add_argument(
        "--budget-s",
        "--max-seconds",
        dest="budget_s",
        type=float,
        default=0.0,
        help="start no seed after this many seconds; the running ones finish (0: no limit)",
    )
    s.add_argument("--trace", action="store_true", help="print a failing seed's whole trace")
    s.add_argument("--out", default="", help="write every seed's result and the run's (JSON)")
    s.add_argument(
        "--merge", nargs="+", default=[], metavar="JSON", help="merge --out files into --report"
    )
    s.add_argument("--report", default="", help="with --merge: the markdown to write")
    s.add_argument(
        "--commit",
        default="",
        help="the commit to record in --out when the checkout has no git (a copied tree)",
    )
    s.set_defaults(func=_cmd)
