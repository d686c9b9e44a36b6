"""Big entries sent in chunks: labelled by their pickled length, gathered whole.

pysyncobj's leader sends an entry of `appendEntriesBatchSizeBytes` or more as
slices of `pickle.dumps(entry)` and flags as the last every slice that reaches
the raw command's length. These tests slice entries exactly as it does and
check what `ChunkFraming` (leader) and `finished_transmission` (follower) make
of them. (Through three real replicas: tests/integration/test_large_commands.py.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import pysyncobj.pickle as raft_pickle

from kvdir.directory.consensus.fixes import ChunkFraming, RaftEntry, finished_transmission

BATCH_BYTES = 65_536  # pysyncobj's appendEntriesBatchSizeBytes default


def entry(n_bytes: int, index: int = 7) -> RaftEntry:
    """A command of random-looking bytes (half >= 0x80: the pickle outgrows it)."""
    out = b""
    i = 0
    while len(out) < n_bytes:
        out += hashlib.blake2b(i.to_bytes(4, "big")).digest()
        i += 1
    return (out[:n_bytes], index, 3)


def pysyncobj_chunks(e: RaftEntry, prev: int) -> list[dict[str, Any]]:
    """The messages pysyncobj 0.3.17's leader sends for `e` (its labelling rule)."""
    data = raft_pickle.dumps(e)
    out = []
    for pos in range(0, len(data), BATCH_BYTES):
        if pos == 0:
            kind = "start"
        elif pos + BATCH_BYTES >= len(e[0]):
            kind = "finish"
        else:
            kind = "process"
        out.append(
            {
                "type": "append_entries",
                "transmission": kind,
                "data": data[pos : pos + BATCH_BYTES],
                "term": 3,
                "commit_index": 5,
                "prevLogIdx": prev,
                "prevLogTerm": 3,
            }
        )
    return out


def test_pysyncobj_flags_several_chunks_as_the_last() -> None:
    kinds = [m["transmission"] for m in pysyncobj_chunks(entry(300_000), 6)]
    assert kinds.count("finish") > 1  # the bug these fixes are for


def test_framing_flags_exactly_the_chunk_that_completes_the_entry() -> None:
    e = entry(300_000)
    framing = ChunkFraming({7: e}.get)
    framed = [framing.frame("peer", m) for m in pysyncobj_chunks(e, 6)]
    kinds = [m["transmission"] for m in framed]
    assert kinds[0] == "start" and kinds[-1] == "finish"
    assert set(kinds[1:-1]) <= {"process"}
    assert b"".join(m["data"] for m in framed) == raft_pickle.dumps(e)


def test_framing_keeps_peers_apart_and_starts_over_at_each_start() -> None:
    e = entry(200_000)
    framing = ChunkFraming({7: e}.get)
    a, b = pysyncobj_chunks(e, 6), pysyncobj_chunks(e, 6)
    out_a = [framing.frame("a", a[0]), framing.frame("b", b[0])]
    out_a += [framing.frame("a", m) for m in a[1:2]]  # a is cut off after two chunks
    out_a += [framing.frame("a", m) for m in a]  # and sent again from the start
    out_b = [framing.frame("b", m) for m in b[1:]]
    assert [m["transmission"] for m in out_a[-len(a) :]][-1] == "finish"
    assert [m["transmission"] for m in out_b][-1] == "finish"
    assert [m["transmission"] for m in out_b].count("finish") == 1


def test_framing_passes_on_what_it_cannot_account_for() -> None:
    e = entry(200_000)
    other = (b"something else" + e[0], 7, 3)
    framing = ChunkFraming({7: other}.get)  # the log holds something else at 7
    msgs = pysyncobj_chunks(e, 6)
    assert [framing.frame("p", m) for m in msgs] == msgs
    plain = {"type": "append_entries", "entries": [], "prevLogIdx": 1}
    assert framing.frame("p", plain) is plain


def test_the_follower_gathers_early_finish_chunks_and_appends_the_whole_entry() -> None:
    e = entry(300_000)
    buffered: Any = ""
    appended: list[dict[str, Any]] = []
    for sent in pysyncobj_chunks(e, 6):  # an old leader's labels, early finishes included
        m = sent
        if m["transmission"] == "finish":
            out = finished_transmission(buffered, m)
            assert out is not None
            if "transmission" not in out:
                appended.append(out)
                buffered = ""
                continue
            m = out
        buffered = m["data"] if m["transmission"] == "start" else buffered + m["data"]
    assert len(appended) == 1
    msg = appended[0]
    assert msg["entries"] == [e] and msg["prevLogIdx"] == 6 and msg["commit_index"] == 5
    assert "data" not in msg


def test_a_finish_with_nothing_gathered_or_not_an_entry_is_refused() -> None:
    m = pysyncobj_chunks(entry(100_000), 6)[-1]
    assert finished_transmission("", m) is None
    not_entry = dict(m, data=raft_pickle.dumps({"x": 1}))
    assert finished_transmission(b"", not_entry) is None
