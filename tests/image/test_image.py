"""The container image, built offline and run for real under podman (deploy/image).

One build per run into a private, empty podman store (tests/image/podman.py):
deploy/image/build.sh, as `make image` runs it, from the cached mmdebstrap
base and wheels. Then:

1. the image itself: labels (version, source commit), the non-root user, the
   HEALTHCHECK, no compilers and no pip inside, only `kvdir` installed;
2. one pod (--network none: only `lo`) of three directory replicas, two
   agents and a gateway, each the same image with its role as the command
   (and a stub engine for the gateway): all six healthy by their
   HEALTHCHECK, every listener on loopback; the gateway sees its backend and
   the directory; an engine in agent a's container stores a
   chain, every replica's `kvdir ctl lookup` finds it, the engine in agent
   b's container looks it up and pulls it from agent a over TCP, byte-exact;
   the leader's container is SIGKILLed and `--restart always` brings it back
   while the others elect a new leader, and its data survives; a graceful
   `podman stop` of the new leader hands leadership over, and `podman pod
   stop` ends every container with exit status 0;
3. `podman kube play` of deploy/k8s's directory as kustomize renders it with
   the image as its parameter, converted where podman 4.3 cannot play it
   (tests/image/kube.py says which kinds and fields, and why).

Skipped with the reason where podman cannot run containers (not root, or
runc refused); the tools missing fail under CI, which installs them.
Timings (build, start-to-ready, failover, stops) are printed (`-s`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvdir.directory.consensus.journal import LOG_FILE
from kvdir.local import ClusterError, wait_for
from tests.deploy.test_k8s import K8S_VERSION
from tests.image import cluster, image, kube
from tests.image import podman as pm
from tests.tools import needs, unavailable

pytestmark = [pytest.mark.image, pytest.mark.integration]

K8S = image.REPO / "deploy" / "k8s"
NAMESPACE = "kvdir"
TAG = "localhost/kvdir:image-tier"
SEED = 19

needs_tools = needs(
    not pm.missing_tools() and image.python_fits(),
    f"the image tier needs {', '.join(pm.TOOLS)} ({pm.INSTALL_HINT}) and Python 3.11 "
    f"(the image's) to build the wheels",
)


def report(what: str, **numbers: Any) -> None:
    print(f"[image tier] {what}: {json.dumps(numbers)}", flush=True)


@pytest.fixture(scope="module")
def podman() -> Iterator[pm.Podman]:
    with open(K8S / "directory.yaml") as f:
        sts = kube.one([d for d in yaml.safe_load_all(f) if d], "StatefulSet")
    store = pm.create({kube.dns_name(sts, 0, NAMESPACE): "127.0.0.1"})
    try:
        why = pm.unusable_reason(store)
        if why:
            unavailable(why)
        yield store
    finally:
        store.reset()


@pytest.fixture(scope="module")
def built(podman: pm.Podman) -> image.Built:
    b = image.build(podman, TAG)
    report("built", seconds=b.seconds, size_mb=round(b.size_bytes / 1e6, 1), ref=b.ref)
    return b


# ---------------------------------------------------------------- the configs


def test_the_pods_configs_load_with_the_daemons_loaders(tmp_path: Path) -> None:
    """What the containers get is valid for the real loaders (so a failure there is the
    image's), and kube.py's conversion of the manifest is still a valid Kubernetes Pod."""
    from kvdir.agent import config as agent_config
    from kvdir.directory import config as directory_config
    from kvdir.gateway import config as gateway_config

    paths = cluster.write_configs(tmp_path)
    for r in cluster.REPLICAS:
        cfg = directory_config.load(str(paths[cluster.replica_container(r)]))
        assert cfg.replica_id == r and len(cfg.peers) == 2
        assert cfg.raft.election_min_s == cluster.RAFT_ON_A_SHARED_HOST["election_min_s"]
    for a in cluster.AGENTS:
        acfg = agent_config.load(str(paths[cluster.agent_container(a)]))
        assert acfg.node_id == f"agent-{a}" and acfg.transports == ("tcp",)
    gcfg = gateway_config.load(str(paths[cluster.GATEWAY]))
    assert gcfg.listen == cluster.GATEWAY_LISTEN
    assert gcfg.backends[0].node_id == cluster.BACKEND_NODE
    with open(K8S / "directory.yaml") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    played = kube.playable_directory(docs, NAMESPACE)
    # the directory's ConfigMap, the Raft password Secret played as a ConfigMap, the claim, the Pod
    kinds = ["ConfigMap", "ConfigMap", "PersistentVolumeClaim", "Pod"]
    assert [d["kind"] for d in played] == kinds
    for d in played:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- the image


@needs_tools
@pytest.mark.timeout(image.BUILD_TIMEOUT_S + 300)
def test_image_labels_user_healthcheck_and_contents(podman: pm.Podman, built: image.Built) -> None:
    labels = built.config["Labels"]
    assert labels["org.opencontainers.image.version"] == image.version()
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == image.git_head()
    assert built.config["User"] == "10001:10001"
    assert built.config["Entrypoint"] == ["kvdir"]
    assert built.healthcheck["Test"] == ["CMD", kube.HEALTHCHECK]
    probe = (
        "id -u; "
        "for t in gcc cc c++ g++ clang ld as make pip pip3; do command -v $t; done; "
        "python -m pip --version >/dev/null 2>&1 && echo has-pip; "
        "ls /opt/kvdir/venv/lib/python3.11/site-packages | grep -v -e dist-info -e '^_' ; "
        "kvdir --help >/dev/null && echo cli-ok"
    )
    out = podman(
        "run", "--rm", "--network", "none", "--read-only", "--entrypoint", "/bin/sh",
        built.ref, "-c", probe,
    ).stdout.split()  # fmt: skip
    assert out[0] == "10001"
    assert "cli-ok" in out and "has-pip" not in out
    assert not [w for w in out if w.startswith("/")], f"compilers or pip inside: {out}"
    for old in ("directory", "agent", "transfer", "proto"):
        assert old not in out, f"{old} installed as a top-level package"
    assert "kvdir" in out


# ---------------------------------------------------------------- the pod


def _start_pod(podman: pm.Podman, ref: str, configs: dict[str, Path]) -> None:
    podman("pod", "create", "--name", cluster.POD, "--network", "none", "--shm-size",
           cluster.SHM_SIZE)  # fmt: skip
    podman(*cluster.backend_args(ref))  # the gateway's backend, up before anything of kvdir's
    t0 = time.monotonic()
    started = {}
    for name, config in configs.items():
        started[name] = time.monotonic()
        podman(*cluster.run_args(name, config, ref))
    waited = time.monotonic()
    ready = podman.wait_healthy(list(configs), cluster.START_TIMEOUT_S)
    report(
        "pod start to ready",
        all_healthy_s=round(waited + max(ready.values()) - t0, 2),
        each_run_to_healthy_s={n: round(waited + s - started[n], 2) for n, s in ready.items()},
    )


def _listening(podman: pm.Podman, name: str) -> set[str]:
    """Local addresses of the LISTEN sockets in the pod's netns (hex, as /proc has them)."""
    out = podman("exec", name, "cat", "/proc/net/tcp", "/proc/net/tcp6").stdout
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and not ln.lstrip()[0].isalpha()]
    return {r[1].rsplit(":", 1)[0] for r in rows if r[3] == "0A"}


def _assert_only_loopback(podman: pm.Podman) -> None:
    pod = json.loads(podman("pod", "inspect", cluster.POD).stdout)
    infra = (pod[0] if isinstance(pod, list) else pod)["InfraConfig"]  # podman 4.3: one object
    assert infra["PortBindings"] in ({}, None) and not infra["HostNetwork"], infra
    via = cluster.agent_container("b")
    interfaces = podman("exec", via, "ls", "/sys/class/net").stdout.split()
    assert interfaces == ["lo"], interfaces
    # Every listener of the five daemons is bound to 127.0.0.1 (or ::1), none to a wildcard.
    loopback = {
        "0100007F",  # 127.0.0.1
        "00000000000000000000000001000000",  # ::1
        "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1 (gRPC's v6 socket for 127.0.0.1)
    }
    assert _listening(podman, via) <= loopback, _listening(podman, via)
    pid = podman.inspect(via, "{{.State.Pid}}")
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")


GATEWAY_HEALTH = f"""
import json, urllib.request
with urllib.request.urlopen("http://{cluster.GATEWAY_LISTEN}/health", timeout=10) as r:
    print(json.dumps(json.load(r)))
"""


def _gateway_routes_to_its_backend(podman: pm.Podman) -> None:
    """The gateway role of the same image: its backend healthy, its directory reachable."""
    out = podman("exec", "-i", cluster.GATEWAY, "python", "-", stdin=GATEWAY_HEALTH).stdout
    health = json.loads(out)
    assert health["healthy_backends"] == [cluster.BACKEND_NODE], health
    assert health["directory_up"] is True, health


def _publish_and_pull(podman: pm.Podman) -> list[str]:
    via = cluster.agent_container("b")
    stored = cluster.engine(podman, "a", "store", SEED)
    hashes: list[str] = stored["hashes"]

    def everywhere() -> bool | None:
        held = [cluster.lookup_blocks(podman, via, r, hashes, "agent-a") for r in cluster.REPLICAS]
        return True if held == [cluster.BLOCKS] * len(cluster.REPLICAS) else None

    cluster.wait(everywhere, cluster.STEP_TIMEOUT_S, "every replica to list agent-a's chain")
    pulled = cluster.engine(podman, "b", "fetch", SEED)
    assert pulled["hashes"] == hashes
    assert pulled["local_blocks"] == 0 and pulled["peers"].get("agent-a") == cluster.BLOCKS
    assert pulled["valid_blocks"] == cluster.BLOCKS and pulled["bytes_match"] is True, pulled
    assert (pulled["source_node"], pulled["transport"]) == ("agent-a", "tcp"), pulled
    return hashes


def _kill_leader_and_see_it_back(podman: pm.Podman, hashes: list[str]) -> None:
    via = cluster.agent_container("b")
    first, term = cluster.wait(
        lambda: cluster.leader(podman, via), cluster.STEP_TIMEOUT_S, "an agreed leader"
    )
    name = cluster.replica_container(first)
    pid = int(podman.inspect(name, "{{.State.Pid}}"))
    restarts = int(podman.inspect(name, "{{.RestartCount}}"))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # the container's main process, as a crash would

    def back() -> int | None:
        state = podman.inspect(name, "{{.RestartCount}} {{.State.Status}} {{.State.Pid}}")
        count, status, new_pid = state.split()
        ok = int(count) == restarts + 1 and status == "running" and int(new_pid) not in (0, pid)
        return int(new_pid) if ok else None

    cluster.wait(back, cluster.STEP_TIMEOUT_S, f"the restart policy to bring {name} back")
    restarted_s = round(time.monotonic() - t0, 2)
    second, term2 = cluster.wait(
        lambda: cluster.leader(podman, via, after_term=term),
        cluster.STEP_TIMEOUT_S,
        "a leader in a later term, agreed by all three",
    )
    podman.wait_healthy([name], cluster.STEP_TIMEOUT_S)
    healthy_s = round(time.monotonic() - t0, 2)
    held = [cluster.lookup_blocks(podman, via, r, hashes, "agent-a") for r in cluster.REPLICAS]
    assert held == [cluster.BLOCKS] * len(cluster.REPLICAS), held  # the restarted one too
    report(
        "leader SIGKILLed",
        killed=first,
        term=term,
        new_leader=second,
        new_term=term2,
        restarted_s=restarted_s,
        killed_container_healthy_s=healthy_s,
    )


def _stop_gracefully(podman: pm.Podman) -> None:
    via = cluster.agent_container("b")
    lead, term = cluster.wait(
        lambda: cluster.leader(podman, via), cluster.STEP_TIMEOUT_S, "the leader to stop"
    )
    name = cluster.replica_container(lead)
    t0 = time.monotonic()
    podman("stop", "--time", str(cluster.STOP_GRACE_S), name, timeout_s=cluster.STOP_GRACE_S + 30)
    leader_stop_s = round(time.monotonic() - t0, 2)
    assert podman.inspect(name, "{{.State.ExitCode}} {{.State.Status}}") == "0 exited"
    logs = podman("logs", name)  # the daemons log JSON lines to stderr
    assert "leadership handed over" in logs.stderr, logs.stderr[-3000:]
    others = tuple(r for r in cluster.REPLICAS if r != lead)
    third, _ = cluster.wait(
        lambda: cluster.leader(podman, via, others, after_term=term),
        cluster.STEP_TIMEOUT_S,
        "a leader among the other two after the graceful stop",
    )
    t0 = time.monotonic()
    podman("pod", "stop", "--time", str(cluster.STOP_GRACE_S), cluster.POD,
           timeout_s=cluster.STOP_GRACE_S + 60)  # fmt: skip
    pod_stop_s = round(time.monotonic() - t0, 2)
    names = [cluster.replica_container(r) for r in cluster.REPLICAS]
    names += [cluster.agent_container(a) for a in cluster.AGENTS]
    names += [cluster.GATEWAY, cluster.BACKEND]
    codes = {n: podman.inspect(n, "{{.State.ExitCode}} {{.State.Status}}") for n in names}
    assert set(codes.values()) == {"0 exited"}, codes  # SIGTERM handled, not SIGKILLed
    report("stopped", leader_stop_s=leader_stop_s, then_leader=third, pod_stop_s=pod_stop_s)


@needs_tools
@pytest.mark.timeout(image.BUILD_TIMEOUT_S + 900)
def test_pod_of_three_replicas_two_agents_and_a_gateway(
    podman: pm.Podman, built: image.Built, tmp_path: Path
) -> None:
    configs = cluster.write_configs(tmp_path)
    try:
        _start_pod(podman, built.ref, configs)
        _assert_only_loopback(podman)
        _gateway_routes_to_its_backend(podman)
        hashes = _publish_and_pull(podman)
        _kill_leader_and_see_it_back(podman, hashes)
        _stop_gracefully(podman)
    finally:
        podman("pod", "rm", "--force", cluster.POD, check=False)


# ---------------------------------------------------------------- kube play


def _render(ref: str, tmp_path: Path) -> list[dict[str, Any]]:
    """deploy/k8s through kustomize with an overlay that names the built image."""
    name, _, tag = ref.rpartition(":")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(K8S, overlay)],
                "images": [{"name": "kvdir", "newName": name, "newTag": tag}],
            }
        )
    )
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@needs_tools
@needs(bool(shutil.which("kubectl")), "kubectl (its kustomize) renders deploy/k8s")
@pytest.mark.timeout(image.BUILD_TIMEOUT_S + 300)
def test_kube_play_of_the_directory_manifest(
    podman: pm.Podman, built: image.Built, tmp_path: Path
) -> None:
    rendered = [d for d in _render(built.ref, tmp_path) if "directory" in d["metadata"]["name"]]
    docs = kube.playable_directory(rendered, NAMESPACE)
    pod = kube.one(docs, "Pod")
    (c,) = pod["spec"]["containers"]
    assert c["image"] == built.ref  # the kustomize parameter reached the pod
    play = tmp_path / "play.yaml"
    play.write_text(yaml.safe_dump_all(docs))
    container = f"{pod['metadata']['name']}-{c['name']}"
    try:
        t0 = time.monotonic()
        podman("kube", "play", "--network", "none", str(play))
        podman.wait_healthy([container], cluster.START_TIMEOUT_S)
        report("kube play to ready", seconds=round(time.monotonic() - t0, 2))
        out = podman(
            "exec", container, "sh", "-c",
            "id -u; grep Cap[EP] /proc/1/status; touch /probe 2>/dev/null || echo read-only; "
            "ls /var/lib/kvdir/directory",
        ).stdout.split()  # fmt: skip
        assert out[0] == "10001" and "read-only" in out  # the securityContext, as played
        assert out[out.index("CapEff:") + 1] == "0000000000000000"
        assert LOG_FILE in out  # the claim's volume holds the replica's Raft log
        fqdn = kube.dns_name(kube.one(rendered, "StatefulSet"), 0, NAMESPACE)
        seen: list[dict[str, Any]] = []

        def leads() -> bool:
            st = json.loads(
                podman("exec", container, "kvdir", "ctl", "status", "--json", "--addr",
                       f"{fqdn}:7101").stdout
            )  # fmt: skip
            seen[:] = list(st.values())
            return len(seen) == 1 and seen[0]["role"] == "ROLE_LEADER"

        # Healthy means serving; the lone replica elects itself a moment later (after
        # its start-up grace and one election timeout), which a fast host can beat.
        try:
            wait_for(leads, cluster.START_TIMEOUT_S, "the lone replica to lead", 0.2)
        except ClusterError as e:
            raise AssertionError(f"{e}; its status last said {seen}") from None
        assert seen[0]["replica_id"] == pod["metadata"]["name"]
        podman("pod", "stop", "--time", str(cluster.STOP_GRACE_S), pod["metadata"]["name"],
               timeout_s=cluster.STOP_GRACE_S + 60)  # fmt: skip
        assert podman.inspect(container, "{{.State.ExitCode}}") == "0"
        podman("kube", "down", str(play))
    finally:
        podman("pod", "rm", "--force", pod["metadata"]["name"], check=False)
