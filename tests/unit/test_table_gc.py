"""The table's key column stays out of the cyclic garbage collector's walks.

Every full collection walks every tracked list element by element, so a key
column of millions of entries made each one cost tens of milliseconds
(`table.untracked` has the numbers). Whatever builds a table's columns (a
fresh table, a snapshot's load or its namespace restriction, a capture) must
leave the key list untracked, and it must still hold and free what it should.
"""

from __future__ import annotations

import gc
import io
import weakref

from kvdir.directory import snapshot
from kvdir.directory.commands import Publish, RegisterNode, Tier
from kvdir.directory.table import Table

NS = "ns-a"


def _table(n: int = 64) -> Table:
    t = Table()
    t.apply(RegisterNode("n1", "127.0.0.1", "127.0.0.1:1", ("tcp",), 1, 30_000, 0))
    for ns in (NS, "ns-b"):
        hs = [(ns + str(i)).encode().ljust(8, b".")[-8:] + i.to_bytes(4, "big") for i in range(n)]
        t.apply(Publish("n1", 1, ns, int(Tier.GPU), hs, [0] * n, [4096] * n, [7] * n, [1] * n))
    return t


def test_fresh_grown_loaded_and_restricted_key_columns_are_untracked() -> None:
    t = Table()
    assert not gc.is_tracked(t.col.key)
    t = _table()
    assert len(t.col.key) == 128 and not gc.is_tracked(t.col.key)  # appends keep it so
    image = snapshot.capture(t)
    assert image.keys == t.col.key and image.keys is not t.col.key
    assert not gc.is_tracked(image.keys)
    restricted = snapshot.restrict(image, {NS})
    assert len(restricted.keys) == 64 and not gc.is_tracked(restricted.keys)
    buf = io.BytesIO()
    snapshot.write_to(buf, image, {}, [])
    loaded, _, _ = snapshot.load(io.BytesIO(buf.getvalue()))
    assert loaded.col.key == t.col.key and not gc.is_tracked(loaded.col.key)
    assert loaded.digest() == t.digest()


def test_an_untracked_column_is_still_freed_with_its_table() -> None:
    t = _table()
    column = t.col.key
    gone = weakref.ref(t)
    probe = weakref.finalize(t, lambda: None)
    del t
    assert gone() is None and not probe.alive  # freed by reference count, no collection
    assert len(column) == 128  # what someone else still holds stays valid
