"""A holder in its own process, for tests that need the peer to die.

`python -m tests.rdma.guest.holder_proc BYTES SEED`: registers BYTES of
memory filled from SEED, prints one JSON line {"descriptor", "region"}, then
answers each JSON line on stdin (a reader's QP params) with its own QP's
params, until stdin closes.
"""

from __future__ import annotations

import json
import mmap
import random
import sys

from kvdir.transfer.rdma import RdmaTransport


def pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def main() -> None:
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    mm = mmap.mmap(-1, size)
    mm[:] = pattern(size, seed)
    t = RdmaTransport()
    region = t.register(memoryview(mm))
    out = {"descriptor": t.descriptor(), "region": [region.address, region.length, region.rkey]}
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        print(json.dumps(t.accept(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
