"""deploy/k8s/shards: 4 directory groups rendered from the base StatefulSet, strict-valid.

Rendered with `kubectl kustomize --load-restrictor=LoadRestrictionsNone` (the
groups reuse deploy/k8s/directory.yaml, outside the overlay's root), then every
document is validated against the Kubernetes schemas. Each group's
StatefulSet, Services and PDB select that group's pods only; each replica is
started with its group and g0's addresses as the shard home; g0 commits
shard-map.json, whose groups are the StatefulSets' own pod addresses. The
replica config template for one group member loads with the real config code.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvdir.core.shard_map import ShardMap
from kvdir.directory.config import load

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHARDS = DEPLOY / "k8s" / "shards"
K8S_VERSION = "1.37.0"
GROUPS = ("g0", "g1", "g2", "g3")


def _render() -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", str(SHARDS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _pods(group: str) -> list[str]:
    return [
        f"kvdir-directory-{group}-{i}.kvdir-directory-{group}.kvdir.svc.cluster.local:7101"
        for i in range(3)
    ]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
def test_groups_render_valid_and_apart() -> None:
    docs = _render()
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert sorted(sets) == [f"kvdir-directory-{g}" for g in GROUPS]
    for g in GROUPS:
        s = sets[f"kvdir-directory-{g}"]
        assert s["spec"]["selector"]["matchLabels"]["kvdir.dev/group"] == g
        assert s["spec"]["serviceName"] == f"kvdir-directory-{g}"
        c = s["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KVDIR_STATEFULSET"] == env["KVDIR_SERVICE"] == f"kvdir-directory-{g}"
        args = c["args"]
        assert args[args.index("--group") + 1] == g
        assert args[args.index("--shard-home") + 1].split(",") == _pods("g0")
        assert ("--shard-map-init" in args) == (g == "g0")
    for d in docs:  # every selector names one group
        sel = d.get("spec", {}).get("selector")
        if isinstance(sel, dict):
            labels = sel.get("matchLabels", sel)
            assert labels.get("kvdir.dev/group") in GROUPS, (d["kind"], d["metadata"]["name"])
    m = ShardMap.from_json((SHARDS / "shard-map.json").read_text())
    assert m.version == 1
    assert {g.group_id: list(g.replicas) for g in m.groups} == {g: _pods(g) for g in GROUPS}


def test_sharded_replica_config_template_loads() -> None:
    cfg = load(str(DEPLOY / "config" / "directory-sharded.toml"))
    assert cfg.group == "g1" and cfg.sharded and len(cfg.shard_home) == 3
