"""`kvdir bench transfer`: KV fetch throughput between real agents, and the publish path.

Against a real 3-replica `LocalCluster` and three real `kvdir agent serve`
processes on this host: holder A (tcp,shm), reader B (tcp only) and reader C
(tcp,shm, so its fetches from A go over shared memory):

1. Fetch of `--sizes-mb` MiB of KV from A into B (tcp) and into C (shm), in
   blocks of the Llama-3-8B shape (128 KiB of KV per token): 16-token blocks
   (2 MiB) and 512-token blocks (64 MiB). The time is the engine's: from
   `EngineClient.fetch` to its answer (directory lookup, transfer, validation
   and the engine RPC). Every fetch is checked byte for byte afterwards, and
   the destination is poisoned before each one, outside the timed region.
   Baselines, interleaved with the fetches rep by rep so drift hits both:
   a raw TCP copy of the same bytes over loopback (this process receives with
   `recv_into` into a preallocated buffer; a child process sends with
   `sendall` from a buffer; one stream, kernel-default socket buffers, and
   once more with the product's 4 MiB buffers for reference) and a raw
   memcpy (memoryview slice assignment between two preallocated buffers).
2. The fixed cost of a fetch: one 64 KiB block end to end, next to an empty
   engine RPC and a bare directory lookup.
3. `EngineClient.stored()` on the caller's thread (batches of 1 and 16 blocks),
   back to back and paced, next to an empty call timed the same way.
4. Time from `stored()` to the block being visible in the reader agent's
   `EngineClient.lookup` (and on every replica), interleaved trial by trial
   with a baseline: a directory Publish from this process, then the same
   polling (the difference is the engine client's and agent's pipeline).

Results go to stdout (Markdown) and bench/results/transfer-DATE.{md,json};
progress to stderr. Every wait has a deadline and every loop a bound. Pool
files live in a temp dir under /dev/shm that is removed at the end.

Package map: config (options, constants), setup (the directory, the agents,
`Bench`), blocks (filling and checking bytes), raw (the raw socket and memcpy
baselines); one module per phase: fetch (1), overhead (2), stored (3),
visibility (4); report (targets and Markdown as data); run (the phase
registry `PHASES` and the entry point). A new phase is a module with
`run(b: Bench) -> None` writing its own key of `b.results`, one line in
`PHASES`, and its goals and section in report.py.
"""

from __future__ import annotations

from typing import Any

from bench.command import add_command
from bench.transfer.config import add_arguments


def add_parser(kinds: Any) -> None:
    from bench.transfer.run import run

    add_command(
        kinds,
        "transfer",
        "KV fetch (tcp, shm) between real agents; publish latency",
        __doc__,
        add_arguments,
        run,
    )


__all__ = ["add_parser"]
