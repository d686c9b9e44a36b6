"""`freeze_startup`: start-up objects leave the collector's walks; later garbage does not.

Each case runs in a fresh interpreter, since freezing is process-wide and the
test process must keep its own collector as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import gc, json, logging, weakref
from kvdir.core.gc_freeze import freeze_startup

records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append({"msg": r.getMessage(), "component": r.component,
                        "frozen": r.frozen_objects})
logging.getLogger("kvdir.gc").addHandler(Keep())
logging.getLogger("kvdir.gc").setLevel(logging.INFO)

class Node:
    pass

startup = [Node() for _ in range(1000)]           # lives for the whole process
dropped = Node()                                    # frozen, then dropped by refcount
dropped_ref = weakref.ref(dropped)
before = len(gc.get_objects())
n = freeze_startup("probe")
frozen_now = gc.get_freeze_count()
after = len(gc.get_objects())

walked = {id(o) for o in gc.get_objects()}
startup_walked = sum(id(o) in walked for o in startup)

del dropped                                         # refcounting still frees frozen objects
refcount_freed = dropped_ref() is None

a, b = Node(), Node()                               # a cycle made after the freeze
a.other, b.other = b, a
cycle_ref = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({
    "returned": n, "freeze_count": frozen_now, "freeze_count_end": gc.get_freeze_count(),
    "before": before, "after": after,
    "startup_walked": startup_walked, "refcount_freed": refcount_freed,
    "later_cycle_collected": cycle_ref() is None, "records": records,
}))
"""


def _probe() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_startup_objects_leave_the_walks_and_later_garbage_is_still_collected() -> None:
    r = _probe()
    assert isinstance(r["returned"], int) and isinstance(r["before"], int)
    assert isinstance(r["freeze_count"], int)
    # What it returned is what it froze; only objects freed since (refcounting still
    # frees frozen objects, and the log record's own call drops a few) have left.
    assert r["returned"] * 0.9 < r["freeze_count"] <= r["returned"]
    assert r["returned"] >= 1000 + 1  # at least our own start-up objects
    assert r["startup_walked"] == 0, "frozen objects are still walked by collections"
    assert isinstance(r["after"], int) and r["after"] < r["before"] // 10
    assert r["refcount_freed"] is True
    assert isinstance(r["freeze_count_end"], int)
    assert r["freeze_count_end"] < r["freeze_count"]  # the dropped one left the frozen set
    assert r["later_cycle_collected"] is True
    assert r["records"] == [
        {
            "msg": f"froze {r['returned']} start-up objects out of garbage collection",
            "component": "probe",
            "frozen": r["returned"],
        }
    ]
