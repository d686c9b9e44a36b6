"""deploy/k8s: every manifest passes the Kubernetes API schemas, offline and strict.

kubernetes-validate (pinned in the dev extras) bundles the OpenAPI schemas, so
the check needs no cluster; strict mode rejects unknown fields. A broken copy
proves the check bites. The directory's entrypoint (in its ConfigMap) is run
with a fake pod name and a stand-in `kvdir`, and the command line it builds is
parsed by the real `kvdir directory serve` config code; the agent's ConfigMap is
loaded by the real agent config code with the DaemonSet's flags. The image is
a kustomize parameter: kustomization.yaml covers every manifest and names the
release, and an overlay rendered by `kubectl kustomize` sets every container's
image (by tag or digest) and still validates.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvdir.agent import config as agent_config
from kvdir.cli import _serve_config, build_parser
from kvdir.directory.config import DirectoryConfig, Peer

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.37.0"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _one(name: str, kind: str, obj_name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in _docs(name)
        if d["kind"] == kind and (obj_name is None or d["metadata"]["name"] == obj_name)
    ]
    assert len(found) == 1, (name, kind, obj_name)
    return found[0]


KUSTOMIZATION = "kustomization.yaml"
MANIFESTS = sorted(f.name for f in K8S.glob("*.yaml") if f.name != KUSTOMIZATION)
ALL = [(name, i) for name in MANIFESTS for i in range(len(_docs(name)))]


@pytest.mark.parametrize(("name", "index"), ALL)
def test_manifest_is_valid(name: str, index: int) -> None:
    kubernetes_validate.validate(_docs(name)[index], K8S_VERSION, strict=True)


def test_validator_rejects_broken_manifests() -> None:
    sts = _one("directory.yaml", "StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = (
        "grpc"
    )
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_directory_statefulset_policy() -> None:
    sts = _one("directory.yaml", "StatefulSet")
    spec = sts["spec"]
    headless = _one("directory.yaml", "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert headless["spec"]["selector"].items() <= labels.items()

    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVDIR_REPLICAS"] == str(spec["replicas"])
    assert env["KVDIR_STATEFULSET"] == sts["metadata"]["name"]
    assert env["KVDIR_SERVICE"] == headless["metadata"]["name"]
    assert c["readinessProbe"]["grpc"]["port"] == int(env["KVDIR_GRPC_PORT"])
    assert "service" not in c["readinessProbe"]["grpc"]  # "" is the replica's overall health
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/lib/kvdir"

    pdb = _one("directory.yaml", "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_agent_daemonset_policy() -> None:
    ds = _one("agent.yaml", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostIPC"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (c,) = pod["containers"]
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/dev/shm", "/run/kvdir", "/etc/kvdir"} <= mounts
    assert "rdma/" in (K8S / "agent.yaml").read_text()  # the optional RDMA resource, commented


def test_agent_configmap_loads_with_the_daemonset_flags(tmp_path: Path) -> None:
    cm = _one("agent.yaml", "ConfigMap")
    path = tmp_path / "agent.toml"
    path.write_text(cm["data"]["agent.toml"])
    ds = _one("agent.yaml", "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("$(NODE_NAME)", "gpu-7").replace("$(HOST_IP)", "10.0.1.7") for a in c["args"]]
    argv[0] = f"--config={path}"
    args = build_parser().parse_args([*c["command"][1:], *argv])
    overrides = {
        "node_id": args.node_id,
        "host": args.host,
        "listen": args.listen,
        "metrics_address": args.metrics,
    }
    cfg = agent_config.load(args.config, overrides)
    assert (cfg.node_id, cfg.listen, cfg.metrics_address) == (
        "gpu-7",
        "10.0.1.7:7301",
        "10.0.1.7:7302",
    )
    directory = _one("directory.yaml", "StatefulSet")["metadata"]["name"]
    assert cfg.directory == tuple(
        f"{directory}-{i}.kvdir-directory.kvdir.svc.cluster.local:7101" for i in range(3)
    )


def _run_entrypoint(tmp_path: Path, hostname: str) -> subprocess.CompletedProcess[str]:
    cm = _one("directory.yaml", "ConfigMap")
    sts = _one("directory.yaml", "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    (tmp_path / "entrypoint.sh").write_text(cm["data"]["entrypoint.sh"])
    (tmp_path / "base.toml").write_text(cm["data"]["directory.toml"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "kvdir"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env |= {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOSTNAME": hostname,
        "POD_NAMESPACE": "kvdir",
        "KVDIR_BASE_CONFIG": str(tmp_path / "base.toml"),
        "KVDIR_CONFIG": str(tmp_path / "run" / "directory.toml"),
        "KVDIR_DATA_DIR": str(tmp_path / "data"),
    }
    return subprocess.run(
        [*c["command"][:1], str(tmp_path / "entrypoint.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_entrypoint_builds_identity_and_peers_from_the_pod_name(tmp_path: Path) -> None:
    r = _run_entrypoint(tmp_path, "kvdir-directory-1")
    assert r.returncode == 0, r.stderr
    argv = r.stdout.splitlines()
    assert argv[:2] == ["directory", "serve"]
    cfg: DirectoryConfig = _serve_config(build_parser().parse_args(argv))

    def fqdn(i: int) -> str:
        return f"kvdir-directory-{i}.kvdir-directory.kvdir.svc.cluster.local"

    assert cfg.replica_id == "kvdir-directory-1"
    assert cfg.raft_address == f"{fqdn(1)}:7001"
    assert cfg.grpc_address == f"{fqdn(1)}:7101"
    assert cfg.metrics_address == "0.0.0.0:7201"
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.peers == tuple(
        Peer(f"kvdir-directory-{i}", f"{fqdn(i)}:7001", f"{fqdn(i)}:7101") for i in (0, 2)
    )
    assert cfg.raft.compaction_min_entries == 20000  # the shared settings came along
    # Off loopback a replica needs a Raft password: the StatefulSet mounts the Secret there.
    assert cfg.auth.raft_password_file == "/etc/kvdir-raft/password"
    pod = _one("directory.yaml", "StatefulSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["raft-password"] == "/etc/kvdir-raft"
    assert volumes["raft-password"]["secret"]["secretName"] == "kvdir-directory-raft"


@pytest.mark.parametrize(
    "hostname", ["kvdir-directory-3", "kvdir-directory", "other-0", "kvdir-directory-x"]
)
def test_entrypoint_refuses_a_pod_it_cannot_place(tmp_path: Path, hostname: str) -> None:
    r = _run_entrypoint(tmp_path, hostname)
    assert r.returncode == 64, (r.stdout, r.stderr)
    assert "entrypoint:" in r.stderr


# ---------------------------------------------------------------- the image parameter


def _images(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        out += [c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])]
    return out


def _version() -> str:
    with open(K8S.parents[1] / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def test_kustomization_covers_every_manifest_and_names_the_release() -> None:
    k = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert sorted(k["resources"]) == MANIFESTS
    (image,) = k["images"]
    assert image == {"name": "kvdir", "newTag": _version()}
    every = [i for name in MANIFESTS for i in _images(_docs(name))]
    assert every and set(every) == {f"kvdir:{_version()}"}  # one name for kustomize to set


def _kustomize(overlay: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed"
)
@pytest.mark.parametrize(
    "image",
    [
        {"newName": "registry.example.com/infra/kvdir", "newTag": "0.1.0-rc1"},
        {"newName": "registry.example.com/infra/kvdir", "digest": "sha256:" + "ab" * 32},
    ],
)
def test_an_overlay_sets_the_image_and_the_result_validates(
    tmp_path: Path, image: dict[str, str]
) -> None:
    overlay = tmp_path / "prod"
    overlay.mkdir()
    (overlay / KUSTOMIZATION).write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(K8S, overlay)],
                "images": [{"name": "kvdir", **image}],
            }
        )
    )
    docs = _kustomize(overlay)
    ref = image["newName"] + (f":{image['newTag']}" if "newTag" in image else "")
    ref += f"@{image['digest']}" if "digest" in image else ""
    assert set(_images(docs)) == {ref}
    assert {d["metadata"].get("namespace") for d in docs} == {"kvdir"}
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(d["kind"] for name in MANIFESTS for d in _docs(name))
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
