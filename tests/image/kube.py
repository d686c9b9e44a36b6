"""deploy/k8s's directory as podman can play it: what it cannot play and the conversion.

podman 4.3's `kube play` plays Pod, Deployment, PersistentVolumeClaim, and a
ConfigMap only as used by a pod; it skips StatefulSet, Service and
PodDisruptionBudget without a word (given only those: "YAML document does not
contain any supported kube kind"). `playable_directory` does what the
StatefulSet controller would, for one ordinal, from the manifests as
kustomize renders them (so the image is the parameter's):

- StatefulSet -> a Pod named `<statefulset>-<ordinal>` (its hostname too, which
  the ConfigMap's entrypoint reads) from the pod template, and its
  volumeClaimTemplates -> a PersistentVolumeClaim `<claim>-<pod>` (podman: a
  named volume) in the pod's volumes;
- Services: nothing to play; the per-pod DNS name resolves through the test's
  hosts file (cluster DNS's job), and a --network none pod has no other
  address to reach anyway;
- PodDisruptionBudget: nothing to play (podman evicts nothing).

Fields podman 4.3 refuses or cannot honour here, converted:

- `env.valueFrom.fieldRef: metadata.namespace` ("fieldPath metadata.namespace
  is either not valid or not supported") -> the namespace as a value;
- `ports` become port mappings, refused under --network none ("PortMappings can
  only be used with Bridge or slirp4netns networking") -> dropped: nothing is
  published;
- podman ignores readiness probes, runs a livenessProbe as the container's
  healthcheck (in place of the image's HEALTHCHECK, which it drops), and runs
  a `tcpSocket` one as `nc -z` inside the container, and the image has no nc
  -> the livenessProbe becomes an `exec` of the image's HEALTHCHECK command
  (`kvdir ctl wait-ready`: the grpc readinessProbe's check, grpc.health.v1
  SERVING), so `podman healthcheck run` answers readiness;
- the Raft password's `secret` volume (podman 4.3 plays a Secret only from
  its own secret store) -> a ConfigMap of the same name holding a password
  generated for the play;
- KVDIR_REPLICAS -> 1: one pod is one replica, a majority of one (three pods
  would be three network namespaces joined by a network, which this tier does
  not create; the three-replica cluster is the pod test's).

Everything else (the ConfigMap and its entrypoint, the pod and container
securityContext, the volumes, resources) is played as written.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

Doc = dict[str, Any]
CLUSTER_DOMAIN = "cluster.local"


def one(docs: list[Doc], kind: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def pod_name(sts: Doc, ordinal: int) -> str:
    return f"{sts['metadata']['name']}-{ordinal}"


def dns_name(sts: Doc, ordinal: int, namespace: str) -> str:
    """The per-pod name the headless Service gives `<statefulset>-<ordinal>`."""
    service = sts["spec"]["serviceName"]
    return f"{pod_name(sts, ordinal)}.{service}.{namespace}.svc.{CLUSTER_DOMAIN}"


HEALTHCHECK = "/usr/local/bin/kvdir-healthcheck"
"""The image's HEALTHCHECK command (deploy/image/Containerfile)."""
PROBE_TIMEOUT_S = 30
"""The image's HEALTHCHECK --timeout (a Python start of the CLI, then up to 5 s of waiting)."""


def _container(c: Doc, namespace: str) -> Doc:
    c = copy.deepcopy(c)
    c.pop("ports", None)
    ready = c.pop("readinessProbe")
    c["livenessProbe"] = {
        "exec": {"command": [HEALTHCHECK]},
        "periodSeconds": ready.get("periodSeconds", 10),
        "timeoutSeconds": PROBE_TIMEOUT_S,
        "failureThreshold": ready.get("failureThreshold", 3),
    }
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef", {})
        if ref.get("fieldPath") == "metadata.namespace":
            del e["valueFrom"]
            e["value"] = namespace
        if e["name"] == "KVDIR_REPLICAS":
            e["value"] = "1"
    return c


def playable_directory(docs: list[Doc], namespace: str, ordinal: int = 0) -> list[Doc]:
    """[ConfigMap, the Secrets as ConfigMaps, PersistentVolumeClaim, Pod] for replica `ordinal`."""
    sts = one(docs, "StatefulSet")
    name = pod_name(sts, ordinal)
    template = sts["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    spec["hostname"] = name
    spec["containers"] = [_container(c, namespace) for c in spec["containers"]]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    claim_name = f"{claim['metadata']['name']}-{name}"
    secret_maps, volumes = _secrets_as_config_maps(spec.get("volumes", []), namespace)
    spec["volumes"] = [
        *volumes,
        {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}},
    ]
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name, "namespace": namespace},
        "spec": copy.deepcopy(claim["spec"]),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(template["metadata"]["labels"]),
        },
        "spec": spec,
    }
    return [copy.deepcopy(one(docs, "ConfigMap")), *secret_maps, pvc, pod]


def _secrets_as_config_maps(volumes: list[Doc], namespace: str) -> tuple[list[Doc], list[Doc]]:
    """Each `secret` volume as a ConfigMap volume, and those ConfigMaps (a fresh
    random value for every key the volume's items name, or `password`)."""
    maps: list[Doc] = []
    out: list[Doc] = []
    for v in volumes:
        if "secret" not in v:
            out.append(v)
            continue
        name = v["secret"]["secretName"]
        keys = [i["key"] for i in v["secret"].get("items", [])] or ["password"]
        data = {k: secrets.token_urlsafe(24) for k in keys}
        maps.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace},
                "data": data,
            }
        )
        out.append({"name": v["name"], "configMap": {"name": name}})
    return maps, out
