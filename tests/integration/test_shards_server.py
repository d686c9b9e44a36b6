"""The sharded directory's server side with real processes (docs/sharding.md):
2 groups x 3 replicas behind one shard map held in g0's log.

The map is committed from g0's init file and every replica routes by it; a
request naming a hash of another group is refused whole with wrong_shard and
the replica's version; SetShardMap is a compare-and-set that refuses stale
versions and invalid maps with a message; `kvdir ctl shards split` commits a
split that a g1 replica learns within its refresh bound; the map survives a
restart of all of g0's replicas from the journal and from a snapshot.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from kvdir import shard_move
from kvdir.core import shard_wire
from kvdir.core.security import PLAIN
from kvdir.core.shard_map import Shard, ShardMap, shard_key
from kvdir.directory import codec
from kvdir.directory.commands import Barrier
from kvdir.directory.shard_service import FETCH_CALL_TIMEOUT_S
from kvdir.local import LocalCluster, Replica, ShardedCluster, wait_for
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc
from tests.integration.helpers import LONG_LEASE_MS, ns

pytestmark = pytest.mark.timeout(240)

REFRESH_MS = 1000
SNAPSHOT_OFTEN = ["--tune", "compaction_min_entries=200", "--tune", "compaction_min_time_s=1"]
SPACE = ns("shards-server")
T = TypeVar("T")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardedCluster]:
    c = ShardedCluster(
        str(tmp_path_factory.mktemp("sharded")),
        groups=2,
        size=3,
        refresh_ms=REFRESH_MS,
        extra_args=SNAPSHOT_OFTEN,
    )
    try:
        c.start(timeout_s=90)
        yield c
    finally:
        c.stop()


def on_group(group: LocalCluster, call: Callable[[pb_grpc.PrefixDirectoryStub], T]) -> T:
    """`call` on the group's replicas in turn until one answers other than
    UNAVAILABLE (bounded: 20 s). Other errors are the answer, raised."""
    deadline = time.monotonic() + 20
    while True:
        for r in group.replicas:
            if not r.alive:
                continue
            with grpc.insecure_channel(r.grpc_address) as ch:
                try:
                    return call(pb_grpc.PrefixDirectoryStub(ch))
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
        time.sleep(0.05)


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert isinstance(err, grpc.RpcError)
    return err


def trailers(e: grpc.RpcError) -> dict[str, str]:
    return {m.key: str(m.value) for m in e.trailing_metadata() or ()}


def get_map(addr: str, min_version: int = 0) -> pb.GetShardMapResponse:
    with grpc.insecure_channel(addr) as ch:
        resp: pb.GetShardMapResponse = pb_grpc.PrefixDirectoryStub(ch).GetShardMap(
            pb.GetShardMapRequest(min_version=min_version), timeout=5
        )
        return resp


def set_map(addr: str, expected: int, m: pb.ShardMap) -> pb.SetShardMapResponse:
    with grpc.insecure_channel(addr) as ch:
        resp: pb.SetShardMapResponse = pb_grpc.DirectoryAdminStub(ch).SetShardMap(
            pb.SetShardMapRequest(expected_version=expected, map=m), timeout=10
        )
        return resp


def owned(m: ShardMap, group_id: str, n: int, salt: int) -> list[bytes]:
    """`n` 8-byte hashes whose keys `group_id` owns under `m`."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        h = ((salt << 32) | i).to_bytes(8, "big")
        if m.shard_of(h).group_id == group_id:
            out.append(h)
        i += 1
    return out


def register(group: LocalCluster, node: str) -> None:
    req = pb.RegisterNodeRequest(
        node_id=node, host="127.0.0.1", incarnation=1, lease_ms=LONG_LEASE_MS
    )
    on_group(group, lambda s: s.RegisterNode(req, timeout=10))


def publish_req(node: str, hashes: list[bytes]) -> pb.PublishRequest:
    n = len(hashes)
    return pb.PublishRequest(
        node_id=node,
        incarnation=1,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=hashes,
        addresses=[0x1000 * (i + 1) for i in range(n)],
        lengths=[4096] * n,
        rkeys=[1] * n,
        generations=[1] * n,
    )


def current_map(sharded: ShardedCluster) -> ShardMap:
    resp = on_group(sharded.home, lambda s: s.GetShardMap(pb.GetShardMapRequest(), timeout=5))
    return shard_wire.from_pb(resp.map)


def test_every_replica_routes_by_the_committed_map(sharded: ShardedCluster) -> None:
    for gid, group in sharded.clusters.items():
        for r in group.replicas:
            resp = get_map(r.grpc_address)
            assert resp.group_id == gid and resp.home == (gid == "g0")
            assert shard_wire.from_pb(resp.map) == sharded.initial_map
            with urllib.request.urlopen(f"http://{r.metrics_address}/metrics", timeout=10) as f:
                text = f.read().decode()
            assert f'kvdir_directory_shard_group{{group="{gid}"}} 1.0' in text
            assert "kvdir_directory_shard_map_version 1.0" in text


def test_a_request_to_the_wrong_group_is_refused_with_the_version(
    sharded: ShardedCluster,
) -> None:
    g0, g1 = sharded.clusters["g0"], sharded.clusters["g1"]
    m = current_map(sharded)
    for group in (g0, g1):
        register(group, "wrong-shard-node")
    mine, theirs = owned(m, "g0", 32, 1), owned(m, "g1", 32, 1)
    on_group(g0, lambda s: s.Publish(publish_req("wrong-shard-node", mine), timeout=10))
    on_group(g1, lambda s: s.Publish(publish_req("wrong-shard-node", theirs), timeout=10))

    mixed = mine[:5] + theirs[:1]
    e = refused(
        lambda: on_group(
            g0, lambda s: s.Publish(publish_req("wrong-shard-node", mixed), timeout=10)
        )
    )
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    meta = trailers(e)
    assert meta["kvdir-reason"] == "wrong_shard"
    assert meta["kvdir-shard-map-version"] == str(m.version)
    assert "owned by group 'g1'" in (e.details() or "") and theirs[0].hex() in (e.details() or "")

    lookup = pb.LookupRequest(namespace=SPACE, block_hashes=theirs[:3])
    e = refused(lambda: on_group(g0, lambda s: s.Lookup(lookup, timeout=10)))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(e)["kvdir-reason"] == "wrong_shard"
    batch = pb.LookupBatchRequest(
        lookups=[pb.LookupRequest(namespace=SPACE, block_hashes=mine[:2]), lookup]
    )
    e = refused(lambda: on_group(g0, lambda s: s.LookupBatch(batch, timeout=10)))
    assert trailers(e)["kvdir-reason"] == "wrong_shard"
    remove = pb.RemoveRequest(
        node_id="wrong-shard-node",
        incarnation=1,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=theirs[:1],
    )
    e = refused(lambda: on_group(g0, lambda s: s.Remove(remove, timeout=10)))
    assert trailers(e)["kvdir-reason"] == "wrong_shard"

    # The owners answer: nothing of the refused requests was applied anywhere.
    got = on_group(g1, lambda s: s.Lookup(lookup, timeout=10))
    assert [(x.node_id, x.prefix_blocks) for x in got.matches] == [("wrong-shard-node", 3)]
    got = on_group(
        g0, lambda s: s.Lookup(pb.LookupRequest(namespace=SPACE, block_hashes=mine), timeout=10)
    )
    assert [(x.node_id, x.prefix_blocks) for x in got.matches] == [("wrong-shard-node", 32)]


def test_set_shard_map_refuses_stale_versions_and_invalid_maps(sharded: ShardedCluster) -> None:
    m = current_map(sharded)
    addr = sharded.home.wait_leader(10).grpc_address  # a follower takes no write
    split = m.with_split(m.shards[0].shard_id, 1000)

    e = refused(lambda: set_map(addr, m.version - 1, shard_wire.to_pb(split)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT  # not expected + 1
    assert trailers(e)["kvdir-reason"] == "bad_shard_map"
    stale = ShardMap(m.version, split.groups, split.shards)
    e = refused(lambda: set_map(addr, m.version - 1, shard_wire.to_pb(stale)))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(e)["kvdir-reason"] == "stale_version"
    assert trailers(e)["kvdir-shard-map-version"] == str(m.version)
    assert f"{m.version} is committed" in (e.details() or "")

    gap = shard_wire.to_pb(split)
    gap.shards[1].lo += 1
    e = refused(lambda: set_map(addr, m.version, gap))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without gaps or overlaps" in (e.details() or "")

    swapped = ShardMap(
        m.version + 1,
        m.groups,
        tuple(
            Shard(s.shard_id, s.lo, s.hi, "g1" if s.group_id == "g0" else "g0") for s in m.shards
        ),
    )
    e = refused(lambda: set_map(addr, m.version, shard_wire.to_pb(swapped)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without a finished move" in (e.details() or "")

    unknown = shard_wire.to_pb(split)
    unknown.shards[0].group_id = "g9"
    e = refused(lambda: set_map(addr, m.version, unknown))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown group 'g9'" in (e.details() or "")

    g1_addr = sharded.clusters["g1"].replicas[0].grpc_address
    e = refused(lambda: set_map(g1_addr, m.version, shard_wire.to_pb(split)))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(e)["kvdir-reason"] == "not_home"
    assert current_map(sharded) == m  # nothing refused was committed


def test_move_steps_refuse_bad_input_with_a_status(sharded: ShardedCluster) -> None:
    addr = sharded.clusters["g1"].wait_leader(10).grpc_address  # a follower takes no write

    def admin(call: Callable[[pb_grpc.DirectoryAdminStub], object]) -> grpc.RpcError:
        with grpc.insecure_channel(addr) as ch:
            return refused(lambda: call(pb_grpc.DirectoryAdminStub(ch)))

    e = admin(lambda s: s.MoveShard(pb.MoveShardRequest(shard_id=1), timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "no move step" in (e.details() or "")
    req = pb.MoveShardRequest(step=pb.MOVE_STEP_FREEZE, shard_id=1, lo=5, hi=5)
    e = admin(lambda s: s.MoveShard(req, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    req = pb.MoveShardRequest(step=pb.MOVE_STEP_IMPORT_DONE, shard_id=77)
    e = admin(lambda s: s.MoveShard(req, timeout=10))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(e)["kvdir-reason"] == "bad_move" and "not being imported" in (e.details() or "")
    imp = pb.ImportShardRequest(shard_id=77, commands=[b"not a command"])
    e = admin(lambda s: s.ImportShard(imp, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a command" in (e.details() or "")
    imp = pb.ImportShardRequest(shard_id=77, commands=[codec.encode(Barrier())])
    e = admin(lambda s: s.ImportShard(imp, timeout=10))
    assert "cannot carry a Barrier" in (e.details() or "")


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_split_is_learned_by_g1_within_its_refresh_bound(sharded: ShardedCluster) -> None:
    before = current_map(sharded)
    home = ",".join(sharded.home.grpc_addresses)
    out = ctl("shards", "split", str(before.shards[0].shard_id), "--addr", home)
    assert out.returncode == 0, out.stderr
    assert f"shard map v{before.version + 1}" in out.stdout
    committed_at = time.monotonic()
    after = current_map(sharded)
    assert after.version == before.version + 1 and len(after.shards) == len(before.shards) + 1

    g1 = sharded.clusters["g1"]
    bound_s = REFRESH_MS / 1000 + 3 * FETCH_CALL_TIMEOUT_S  # one period plus one bounded step
    learned: dict[str, float] = {}

    def all_learned() -> bool:
        for r in g1.replicas:
            if r.replica_id not in learned and get_map(r.grpc_address).map.version >= after.version:
                learned[r.replica_id] = time.monotonic() - committed_at
        return len(learned) == len(g1.replicas)

    wait_for(all_learned, bound_s + 5, "every g1 replica to learn the split", 0.02)
    assert max(learned.values()) <= bound_s, learned

    status = ctl("shards", "--addr", home)
    assert status.returncode == 0, status.stderr
    assert f"shard map v{after.version}" in status.stdout
    assert "group g0:" in status.stdout and "group g1:" in status.stdout
    assert status.stdout.count(" term ") == 6  # every replica of both groups answered

    bad = ctl("shards", "split", "99999", "--addr", home)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert "no shard 99999" in bad.stderr


def publish_routed(sharded: ShardedCluster, req: pb.PublishRequest) -> None:
    """Publish to the group owning the batch under the newest map; on wrong_shard,
    read the map again and resend (bounded). Returns once acknowledged."""
    for _ in range(50):
        m = current_map(sharded)
        owner = m.shard_of(req.block_hashes[0]).group_id
        try:
            on_group(sharded.clusters[owner], lambda s: s.Publish(req, timeout=10))
            return
        except grpc.RpcError as e:
            if trailers(e).get("kvdir-reason") != "wrong_shard":
                raise
        time.sleep(0.05)
    raise AssertionError("still refused as wrong_shard after 50 map reads")


def test_a_move_under_publishes_loses_no_acknowledged_write(sharded: ShardedCluster) -> None:
    g0, g1 = sharded.clusters["g0"], sharded.clusters["g1"]
    m = current_map(sharded)
    s = next(x for x in m.shards if x.group_id == "g0")
    for group in (g0, g1):
        register(group, "mover")
    in_s = [h for h in owned(m, "g0", 4000, 7) if s.lo <= shard_key(h) < s.hi]
    batches = [in_s[i : i + 20] for i in range(0, len(in_s), 20)]
    publish_routed(sharded, publish_req("mover", batches[0]))
    acked: list[list[bytes]] = [batches[0]]
    home = ",".join(g0.grpc_addresses)
    move = ["move", str(s.shard_id), "--to", "g1", "--addr", home, "--timeout", "120"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdir.cli", "ctl", "shards", *move],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for batch in batches[1:-1]:  # publishes go on through the move
            publish_routed(sharded, publish_req("mover", batch))
            acked.append(batch)
            if proc.poll() is not None:
                break
        out, err = proc.communicate(timeout=150)
        publish_routed(sharded, publish_req("mover", batches[-1]))  # and after it
        acked.append(batches[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert f"moved shard {s.shard_id} to group g1" in out and "source frozen at index" in out
    after = current_map(sharded)
    assert after.shard_of(in_s[0]).group_id == "g1" and after.version == m.version + 2
    # Publishes straddled the move: the first reached g0 (imported, then dropped there),
    # the last went to g1 under the new map.
    dropped = int(re.search(r"source dropped (\d+) entries", out).group(1))  # type: ignore[union-attr]
    assert dropped >= len(batches[0]), out
    for batch in acked:  # every acknowledged write is in its new group
        lk = pb.LookupRequest(namespace=SPACE, block_hashes=batch, linearizable=True)
        got = on_group(g1, lambda stub, lk=lk: stub.Lookup(lk, timeout=10))  # type: ignore[misc]
        assert [(x.node_id, x.prefix_blocks) for x in got.matches] == [("mover", len(batch))]
    sharded.wait_map_version(after.version, 30)
    lk = pb.LookupRequest(namespace=SPACE, block_hashes=acked[0])
    e = refused(lambda: on_group(g0, lambda stub: stub.Lookup(lk, timeout=10)))
    assert trailers(e)["kvdir-reason"] == "wrong_shard"
    # The old owner dropped the shard and keeps it fenced against pre-move maps.
    e = refused(lambda: on_group(g0, lambda stub: stub.Publish(publish_req("mover", in_s[:1]))))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_move_goes_on_when_the_source_replica_it_follows_dies(sharded: ShardedCluster) -> None:
    """The orchestrator follows the source's Watch on its first replica; killed once the
    snapshot is imported, the Watch is opened again on the next replica from the last
    index imported, and the move finishes with every acknowledged write."""
    g0, g1 = sharded.clusters["g0"], sharded.clusters["g1"]
    m = current_map(sharded)
    s = next(x for x in m.shards if x.group_id == "g1")
    for group in (g0, g1):
        register(group, "survivor")
    in_s = [h for h in owned(m, "g1", 3000, 23) if s.lo <= shard_key(h) < s.hi]
    batches = [in_s[i : i + 20] for i in range(0, len(in_s), 20)]
    for batch in batches[:-1]:
        publish_routed(sharded, publish_req("survivor", batch))
    watched = next(r for r in g1.replicas if r.grpc_address == m.group("g1").replicas[0])
    said: list[str] = []
    killed: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("imported the source's snapshot") and not killed:
            killed.append(watched.replica_id)
            g1.kill(watched, signal.SIGKILL)

    try:
        home = tuple(g0.grpc_addresses)
        fetch = lambda: current_map(sharded)  # noqa: E731
        done = shard_move.move(home, PLAIN, fetch, s.shard_id, "g0", 120, say)
    finally:
        if not watched.alive:
            g1.launch(watched)
    assert killed and any("Watch on" in line and "broke" in line for line in said), said
    assert done.shard_of(in_s[0]).group_id == "g0" and current_map(sharded) == done
    publish_routed(sharded, publish_req("survivor", batches[-1]))
    for batch in batches:  # every acknowledged write is in its new group
        lk = pb.LookupRequest(namespace=SPACE, block_hashes=batch, linearizable=True)
        got = on_group(g0, lambda stub, lk=lk: stub.Lookup(lk, timeout=10))  # type: ignore[misc]
        assert [(x.node_id, x.prefix_blocks) for x in got.matches] == [("survivor", len(batch))]
    sharded.wait_map_version(done.version, 60)  # the killed replica serves again


def test_a_caller_with_a_newer_map_makes_a_replica_refresh_at_once(
    sharded: ShardedCluster,
) -> None:
    before = current_map(sharded)
    s = before.shards[-1]
    addr = sharded.home.wait_leader(10).grpc_address
    set_map(addr, before.version, shard_wire.to_pb(before.with_split(s.shard_id, 500)))
    # Asked at once (the periodic refresh is up to 1 s away): each replica fetches first.
    for r in sharded.clusters["g1"].replicas:
        resp = get_map(r.grpc_address, min_version=before.version + 1)
        assert resp.map.version == before.version + 1


def restart_home(sharded: ShardedCluster) -> None:
    """Kill every g0 replica and start them again. Meanwhile the other group goes
    on routing by the map it has: the home group is needed for changes only."""
    g0, g1 = sharded.home, sharded.clusters["g1"]
    for r in g0.replicas:
        g0.kill(r, signal.SIGKILL)
    m = current_map_of(g1)
    hashes = owned(m, "g1", 3, 11)
    register(g1, "home-down-node")
    on_group(g1, lambda s: s.Publish(publish_req("home-down-node", hashes), timeout=10))
    lookup = pb.LookupRequest(namespace=SPACE, block_hashes=hashes, linearizable=True)
    got = on_group(g1, lambda s: s.Lookup(lookup, timeout=10))
    assert [(x.node_id, x.prefix_blocks) for x in got.matches] == [("home-down-node", 3)]
    for r in g0.replicas:
        g0.launch(r)
    g0.wait_leader(60)


def current_map_of(group: LocalCluster) -> ShardMap:
    resp = on_group(group, lambda s: s.GetShardMap(pb.GetShardMapRequest(), timeout=5))
    return shard_wire.from_pb(resp.map)


def test_the_map_survives_restarts_of_g0_from_journal_and_snapshot(
    sharded: ShardedCluster,
) -> None:
    m = current_map(sharded)
    restart_home(sharded)  # from the journal (no compaction yet: few entries)
    sharded.wait_map_version(m.version, 60)
    assert current_map(sharded) == m

    # Enough commands to compact every g0 replica's log past the SetShardMaps.
    g0 = sharded.home
    register(g0, "snapshot-node")
    hb = pb.HeartbeatRequest(node_id="snapshot-node", incarnation=1)
    before = {r.replica_id: st.last_compaction_s for r in g0.replicas for st in [status(r)]}

    def compacted() -> bool:
        on_group(g0, lambda s: s.Heartbeat(hb, timeout=10))
        return all(status(r).last_compaction_s != before[r.replica_id] for r in g0.replicas)

    wait_for(compacted, 120, "every g0 replica to compact its log", 0.0)
    restart_home(sharded)
    sharded.wait_map_version(m.version, 60)
    assert current_map(sharded) == m
    for r in g0.replicas:
        assert shard_wire.from_pb(get_map(r.grpc_address).map) == m
    assert os.path.isdir(g0.replicas[0].data_dir)


def test_ctl_lookup_and_nodes_with_sharded_merge_every_group(sharded: ShardedCluster) -> None:
    """`kvdir ctl lookup --sharded` routes a chain whose blocks live in both groups by the
    map and merges the answers; without it the home group alone refuses the blocks it
    does not own, in one line."""
    m = current_map(sharded)
    a, b = owned(m, "g0", 6, 11), owned(m, "g1", 6, 12)
    chain = [h for pair in zip(a, b, strict=True) for h in pair]  # alternating owners
    for g in ("g0", "g1"):
        register(sharded.clusters[g], "ctl-node")
    publish_routed(sharded, publish_req("ctl-node", a))
    publish_routed(sharded, publish_req("ctl-node", b))
    home = ",".join(sharded.home.grpc_addresses)
    space = ["--model", SPACE.model, "--block-tokens", str(SPACE.block_tokens)]
    space += ["--dtype", SPACE.dtype, "--layout", SPACE.layout]
    hashes = ["--hashes", ",".join(h.hex() for h in chain)]
    out = ctl("lookup", "--sharded", "--linearizable", "--addr", home, *space, *hashes, "--json")
    assert out.returncode == 0, out.stderr
    matches = json.loads(out.stdout)["matches"]
    assert [(x["node_id"], x["prefix_blocks"]) for x in matches] == [("ctl-node", len(chain))]
    nodes = ctl("nodes", "--sharded", "--addr", home, "--json")
    assert nodes.returncode == 0, nodes.stderr
    listed = {x["node_id"]: int(x.get("entries", 0)) for x in json.loads(nodes.stdout)["nodes"]}
    assert listed.get("ctl-node") == len(chain)  # both groups' entries, summed
    alone = ctl("lookup", "--addr", home, *space, *hashes)
    assert alone.returncode != 0 and len(alone.stderr.strip().splitlines()) == 1, alone.stderr
    assert "shard" in alone.stderr, alone.stderr


def status(r: Replica) -> pb.ClusterStatusResponse:
    with grpc.insecure_channel(r.grpc_address) as ch:
        resp: pb.ClusterStatusResponse = pb_grpc.PrefixDirectoryStub(ch).ClusterStatus(
            pb.ClusterStatusRequest(), timeout=5
        )
        return resp


def test_an_unsharded_replica_answers_no_map(tmp_path: Path) -> None:
    with LocalCluster(str(tmp_path), size=1) as c:
        c.start(30)
        resp = get_map(c.replicas[0].grpc_address)
        assert not resp.HasField("map") and resp.group_id == "g0" and not resp.home
