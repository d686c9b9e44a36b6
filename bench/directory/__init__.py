"""`kvdir bench directory`: the directory's lookup, publish, failover, compaction and memory costs.

Against a real 3-replica `LocalCluster` (three `kvdir directory serve`
processes serving the Echo baseline too) loaded through Publish:

1. publish throughput of the load itself (batches through the leader, several
   in flight);
2. single Lookup latency (one request in flight) and throughput (several
   client processes), against one follower;
3. the Echo baseline with the same request and response sizes and the same
   concurrency, interleaved with the lookups (A B B A) so drift hits both;
4. LookupBatch chains/s and per-RPC latency;
5. leader SIGKILLs under a continuous writer: the write gap, the election
   time (from the replica logs), and afterwards a linearizable check that no
   acknowledged entry was lost;
6. log compaction on replicas holding the full load, with Raft terms watched
   on every replica across it;

and, in a separate process, the table's bytes per entry at `--memory-entries`.

Results go to stdout (Markdown) and to bench/results/directory-DATE.{md,json}.
Progress goes to stderr. Every wait has a deadline and every loop a count.

Package map (one module per phase; shared pieces apart):

- config: the options and `Config`;  cluster: `Bench`, the cluster under test
  and the state phases hand each other;  threads: writer, heartbeats, watchers;
  rpc: timed RPC load from the worker processes;  logs: the replica logs.
- phases: publish (the load, publish throughput, replica RSS), lookups (Lookup
  and the Echo baseline, with echo), batch (LookupBatch), failover (leader
  kills), compaction, verify (no acknowledged write lost), memory (table
  bytes per entry, a subprocess after the cluster stopped).
- report: targets (`GOALS`) and the Markdown (`SECTIONS`), as data;  run: the
  phase registry `PHASES` and the entry point.

Adding a phase (e.g. durability): write `bench/directory/durability.py` with a
`run(b: Bench) -> None` that stores its results under its own key of
`b.results` (use `bench.measure` for statistics and waits), and add one line
`Phase("durability", durability.run)` to `PHASES` in run.py, at the place in
the order it needs. To report it, add its `Goal`s to `GOALS` and a `Section`
to `SECTIONS` in report.py (plus a context line if it has table rows).
"""

from __future__ import annotations

from typing import Any

from bench.command import add_command
from bench.directory.config import add_arguments


def add_parser(kinds: Any) -> None:
    from bench.directory.run import run

    add_command(
        kinds,
        "directory",
        "directory lookup/publish/failover benchmark",
        __doc__,
        add_arguments,
        run,
    )


__all__ = ["add_parser"]
