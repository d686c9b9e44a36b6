"""N shard groups of real replica processes on 127.0.0.1 behind one shard map.

Each group is a `LocalCluster` (3 `kvdir directory serve` processes, own Raft
ports, journals and Watch) started with `--group gI --shard-home <g0's gRPC
addresses>`; group g0 also gets `--shard-map-init` with the version-1 map
(`even_map` over the groups). Used by `kvdir bench directory --shards` and the
sharded integration tests.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvdir.core.shard_map import Group, ShardMap, even_map
from kvdir.local import LocalCluster, Replica

HOME_GROUP = "g0"


@dataclass
class ShardedCluster:
    base_dir: str
    groups: int = 2
    size: int = 3
    shards_per_group: int = 1
    extra_args: list[str] = field(default_factory=list)
    clusters: dict[str, LocalCluster] = field(default_factory=dict)
    shard_map: ShardMap | None = None

    def __post_init__(self) -> None:
        for i in range(self.groups):
            gid = f"g{i}"
            d = os.path.join(self.base_dir, gid)
            os.makedirs(d, exist_ok=True)
            self.clusters[gid] = LocalCluster(d, size=self.size)
        self.shard_map = even_map(
            [Group(g, tuple(c.grpc_addresses)) for g, c in self.clusters.items()],
            self.shards_per_group,
        )
        map_file = os.path.join(self.base_dir, "shard-map.json")
        with open(map_file, "w") as f:
            f.write(self.shard_map.to_json())
        home = ",".join(self.home)
        for gid, c in self.clusters.items():
            c.extra_args = ["--group", gid, "--shard-home", home, *self.extra_args]
            if gid == HOME_GROUP:
                c.extra_args += ["--shard-map-init", map_file]

    @property
    def map(self) -> ShardMap:
        assert self.shard_map is not None
        return self.shard_map

    @property
    def home(self) -> list[str]:
        return self.clusters[HOME_GROUP].grpc_addresses

    def replicas(self) -> Iterator[tuple[str, Replica]]:
        for gid, c in self.clusters.items():
            for r in c.replicas:
                yield gid, r

    def pids(self) -> list[int]:
        return [r.proc.pid for _, r in self.replicas() if r.proc is not None and r.alive]

    def start(self, timeout_s: float = 60.0) -> None:
        """Launch every replica of every group at once, then wait for each group's leader."""
        for c in self.clusters.values():
            for r in c.replicas:
                c.launch(r)
        for c in self.clusters.values():
            c.wait_leader(timeout_s)

    def kill_group(self, gid: str) -> None:
        c = self.clusters[gid]
        for r in c.replicas:
            c.kill(r, signal.SIGKILL)

    def stop(self) -> None:
        for c in self.clusters.values():
            c.stop()

    def __enter__(self) -> ShardedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
