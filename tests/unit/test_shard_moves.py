"""The move protocol's server half in the state machine (directory/shard_moves.py):
a source group freezes and drops a shard, a target group imports it, and the
apply-time fences refuse writes that a stale map would let through."""

from __future__ import annotations

import io

from kvdir.core.shard_map import KEY_SPACE
from kvdir.directory import snapshot
from kvdir.directory.block_index import SHARDS
from kvdir.directory.commands import (
    BeginImport,
    ClearNode,
    Done,
    DropShard,
    Expired,
    ExpireNodes,
    FreezeShard,
    Import,
    ImportDone,
    Publish,
    Published,
    Reject,
    Rejected,
    Remove,
    Removed,
)
from kvdir.directory.shard_fence import Range, key_of
from kvdir.directory.shard_import import snapshot_publishes, within
from kvdir.directory.table import Table
from tests.unit.helpers import (
    NS,
    chain,
    holders,
    must_publish,
    must_register,
    publish,
    publish_cmd,
    view,
)

S_ID, S_LO, S_HI = 5, 0, KEY_SPACE // 2
"""The moving shard: the lower half of the key space."""
HASHES = chain(400)
IN_S = [x for x in HASHES if key_of(x) < S_HI]
OUT_S = [x for x in HASHES if key_of(x) >= S_HI]


def rejected(res: object, reason: Reject) -> str:
    assert isinstance(res, Rejected) and res.reason is reason, res
    return res.message


def drop_all(t: Table) -> int:
    removed = 0
    for part in range(SHARDS):
        res = t.apply(DropShard(S_ID, part))
        assert isinstance(res, Removed), (part, res)
        removed += res.removed
    return removed


def test_a_frozen_shard_takes_no_write_and_deletions_still_apply() -> None:
    a = Table()
    must_register(a, "n1")
    must_publish(a, "n1", IN_S[:10] + OUT_S[:10])
    assert a.apply(FreezeShard(S_ID, S_LO, S_HI)) == Done()
    assert a.apply(FreezeShard(S_ID, S_LO, S_HI)) == Done()  # a retried proposal
    message = rejected(publish(a, "n1", OUT_S[10:12] + IN_S[10:11]), Reject.SHARD_FENCED)
    assert f"shard {S_ID}, moving away (frozen)" in message and IN_S[10].hex() in message
    assert a.entries == 20  # refused whole: not even the keys outside S
    rejected(a.apply(Remove("n1", 1, NS, 1, IN_S[:1])), Reject.SHARD_FENCED)
    must_publish(a, "n1", OUT_S[10:12])  # outside S: as before
    assert a.apply(ClearNode("n1", 1, None, False)) == Removed(22)
    rejected(a.apply(FreezeShard(6, S_HI - 1, S_HI + 1)), Reject.BAD_MOVE)  # overlaps S


def test_an_importing_shard_takes_imports_only_until_import_done() -> None:
    b = Table()
    must_register(b, "n1")
    must_register(b, "n2", incarnation=3)
    rejected(b.apply(Import(S_ID, publish_cmd("n1", IN_S[:2]))), Reject.BAD_MOVE)
    assert b.apply(BeginImport(S_ID, S_LO, S_HI)) == Done()
    rejected(publish(b, "n1", IN_S[:1]), Reject.SHARD_FENCED)  # a client's write: not yet
    must_publish(b, "n1", OUT_S[:3])  # B's own shards are not fenced
    assert b.apply(Import(S_ID, publish_cmd("n1", IN_S[:8]))) == Published(8, 0)
    # n2 at incarnation 2 in A's log, 3 here: its restart cleared it; stale, not applied.
    assert b.apply(Import(S_ID, publish_cmd("n2", IN_S[:4], incarnation=2))) == Published(0, 4)
    assert b.apply(Import(S_ID, publish_cmd("n9", IN_S[:4]))) == Published(0, 4)
    message = rejected(b.apply(Import(S_ID, publish_cmd("n1", OUT_S[:1]))), Reject.BAD_BATCH)
    assert "outside shard 5" in message
    assert b.apply(Import(S_ID, Remove("n1", 1, NS, 1, IN_S[:2]))) == Removed(2)
    # A's ClearNode and expiry reach S's keys only: B's own shards keep n1's entries.
    assert b.apply(Import(S_ID, ClearNode("n1", 1, NS, False))) == Removed(6)
    assert b.apply(Import(S_ID, publish_cmd("n1", IN_S[:3]))) == Published(3, 0)
    assert b.apply(Import(S_ID, ExpireNodes(0, (("n1", 1),)))) == Expired((), 3)
    assert holders(b, OUT_S[:3]) == [("n1", 3)]
    assert b.apply(ImportDone(S_ID)) == Done()
    rejected(b.apply(ImportDone(S_ID)), Reject.BAD_MOVE)
    must_publish(b, "n1", IN_S[:2])  # S is B's now


def test_drop_goes_part_by_part_in_order_and_keeps_the_fence() -> None:
    a, reference = Table(), Table()
    for t in (a, reference):
        must_register(t, "n1")
        must_register(t, "n2")
        must_publish(t, "n1", OUT_S)
    must_publish(a, "n1", IN_S)
    must_publish(a, "n2", IN_S[:50])
    rejected(a.apply(DropShard(S_ID, 0)), Reject.BAD_MOVE)  # not frozen
    a.apply(FreezeShard(S_ID, S_LO, S_HI))
    rejected(a.apply(DropShard(S_ID, 1)), Reject.BAD_MOVE)  # part 0 first
    assert drop_all(a) == len(IN_S) + 50
    assert a.apply(DropShard(S_ID, SHARDS - 1)) == Removed(0)  # a retried last part
    rejected(a.apply(DropShard(S_ID, 0)), Reject.BAD_MOVE)
    # S gone, nothing else touched; the fence stays (a stale-map replica must still refuse).
    rejected(publish(a, "n1", IN_S[:1]), Reject.SHARD_FENCED)
    reference.apply(FreezeShard(S_ID, S_LO, S_HI))
    for part in range(SHARDS):
        reference.apply(DropShard(S_ID, part))
    assert a.digest() == reference.digest()
    # Moving S back to this group lifts the finished fence; an unfinished one stays.
    rejected(a.apply(BeginImport(8, S_LO, S_HI // 2)), Reject.BAD_MOVE)  # S is not inside
    assert a.apply(BeginImport(8, S_LO, S_HI)) == Done()
    assert S_ID not in a.fence.frozen and 8 in a.fence.importing


def test_a_whole_move_leaves_the_target_with_the_source_s_shard() -> None:
    """A's snapshot, then A's later commands, imported into B up to A's freeze."""
    a, b = Table(), Table()
    for t in (a, b):
        must_register(t, "n1")
        must_register(t, "n2")
    must_publish(a, "n1", IN_S[:40] + OUT_S[:40], addr=0x10_000)
    b.apply(BeginImport(S_ID, S_LO, S_HI))
    # The snapshot's entries of S, as publishes (what the importer builds from a Watch).
    b.apply(Import(S_ID, publish_cmd("n1", IN_S[:40], addr=0x10_000)))
    # Then A's log after its snapshot, filtered to S, in A's order.
    later: list[Publish | Remove] = [
        publish_cmd("n2", IN_S[40:60], addr=0x20_000),
        Remove("n1", 1, NS, 1, IN_S[:5]),
        publish_cmd("n1", IN_S[:2], addr=0x30_000, gen=2),
    ]
    for cmd in later:
        a.apply(cmd)
        b.apply(Import(S_ID, cmd))
    a.apply(FreezeShard(S_ID, S_LO, S_HI))
    rejected(publish(a, "n2", IN_S[60:61]), Reject.SHARD_FENCED)  # never reaches B: refused
    b.apply(ImportDone(S_ID))
    for chain_ in (IN_S[:40], IN_S[40:60], IN_S[:2]):
        assert view(b, chain_) == view(a, chain_)
        assert all(view(b, [x]) == view(a, [x]) for x in chain_)  # not only prefixes
    drop_all(a)
    assert holders(a, IN_S[:2]) == []


def test_fences_survive_a_snapshot() -> None:
    t = Table()
    must_register(t, "n1")
    must_publish(t, "n1", HASHES)
    t.apply(FreezeShard(S_ID, S_LO, S_HI))
    t.apply(BeginImport(9, S_HI, S_HI + 1000))
    for part in range(3):
        t.apply(DropShard(S_ID, part))
    buf = io.BytesIO()
    snapshot.write_to(buf, snapshot.capture(t), {}, [])
    buf.seek(0)
    loaded, _, _ = snapshot.load(buf)
    assert loaded.digest() == t.digest()
    assert loaded.fence.to_json() == t.fence.to_json()
    rejected(loaded.apply(DropShard(S_ID, 2)), Reject.BAD_MOVE)  # progress kept: part 3 next
    assert isinstance(loaded.apply(DropShard(S_ID, 3)), Removed)
    rejected(publish(loaded, "n1", IN_S[:1]), Reject.SHARD_FENCED)


def test_an_import_built_from_a_snapshot_and_the_log_rebuilds_the_shard() -> None:
    """directory/shard_import.py: the source's snapshot as Publishes, then its later
    commands cut down to S, give the target exactly the source's S."""
    a, b = Table(), Table()
    for t in (a, b):
        must_register(t, "n1")
        must_register(t, "n2")
    must_publish(a, "n1", HASHES, addr=0x10_000)
    must_publish(a, "n2", HASHES[:100], addr=0x20_000, tier=2)
    buf = io.BytesIO()
    snapshot.write_to(buf, snapshot.capture(a), {}, [])
    buf.seek(0)
    source, _, _ = snapshot.load(buf)
    s = Range(S_ID, S_LO, S_HI)
    b.apply(BeginImport(S_ID, S_LO, S_HI))
    for pub in snapshot_publishes(source, s, batch=50):
        assert all(s.holds(key_of(x)) for x in pub.hashes) and len(pub.hashes) <= 50
        assert isinstance(b.apply(Import(S_ID, pub)), Published)
    later: list[Publish | Remove | ClearNode] = [
        publish_cmd("n1", HASHES[:20], addr=0x30_000, gen=2),
        Remove("n2", 1, NS, 2, HASHES[:30], [1] * 30, [0x20_000 + i for i in range(30)]),
        ClearNode("n1", 1, NS, False),
        publish_cmd("n1", HASHES[:10], addr=0x40_000, gen=3),
    ]
    for cmd in later:
        assert not isinstance(a.apply(cmd), Rejected)
        cut = within(cmd, s)
        if cut is not None:
            assert not isinstance(b.apply(Import(S_ID, cut)), Rejected)
    assert within(publish_cmd("n1", OUT_S[:3]), s) is None
    b.apply(ImportDone(S_ID))
    for x in HASHES:
        expected = view(a, [x]) if s.holds(key_of(x)) else []
        assert view(b, [x]) == expected, x.hex()
