"""What the rdma backend needs to know before pyverbs loads, and what this machine can do.

`RdmaOptions` is built by the agent from its configuration without importing
pyverbs; `capabilities()` is the capability report (`python -m
transfer.rdma_support` prints it as JSON): whether pyverbs imports, which
devices and active ports exist, and whether the GPU path (dma-buf memory
registration, transfer/rdma_gpu.py) could even be attempted here.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Exchange = Callable[[dict[str, str], dict[str, str]], dict[str, str]]
"""(holder's descriptor, our QP's params) -> the holder's QP params (the agent's ConnectRdma)."""


ERROR_KINDS = ("completion", "deadline", "connect", "post", "flush", "accept")
"""What `RdmaErrors` counts:
completion: a READ completed with an error status (the QP went to ERR; status names it);
deadline: a READ did not complete in time (the QP was moved to ERR and flushed);
connect: setting up a reader's QP failed (ConnectRdma, or the RTR/RTS transitions);
post: post_send refused work requests;
flush: moving a failed QP to ERR or draining it failed;
accept: the holder side of ConnectRdma could not create or connect a QP."""
ERROR_STATUSES_MAX = 64
"""Distinct completion statuses kept (ibverbs defines ~22); the rest count as "other"."""


class RdmaErrors:
    """RDMA failures by kind (and completion status), counted by the transport.

    Thread-safe. The agent creates one, hands it to the transport through
    `RdmaOptions.errors`, and exports it as kvdir_agent_rdma_errors_total.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {(k, ""): 0 for k in ERROR_KINDS}

    def add(self, kind: str, status: str = "") -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown rdma error kind {kind!r}")
        full = len(ERROR_KINDS) + ERROR_STATUSES_MAX
        with self._lock:
            key = (kind, status)
            if key not in self._counts and len(self._counts) >= full:
                key = (kind, "other")
            self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """(kind, status) -> count; every kind is present (with status "") from the start."""
        with self._lock:
            return dict(self._counts)

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(n for (k, _), n in self._counts.items() if k == kind)


@dataclass(frozen=True, slots=True)
class RdmaOptions:
    device: str = ""
    """ibverbs device name (mlx5_0, rxe0, ...); empty: the first device with an active port."""
    port: int = 0
    """Port number; 0: the device's first active port."""
    gid_index: int = -1
    """GID table index; -1: the first RoCE v2 IPv4-mapped GID (RoCE) or 0 (InfiniBand)."""
    endpoint: str = ""
    """Where this node's agent answers ConnectRdma (goes into the descriptor)."""
    node_id: str = ""
    """This node (goes into the descriptor; readers name it back in ConnectRdma)."""
    exchange: Exchange | None = None
    """How a reader reaches a holder's `accept` (the agent's ConnectRdma RPC)."""
    errors: RdmaErrors | None = None
    """Where the transport counts its failures (the agent exports them); None: its own."""


def capabilities() -> dict[str, Any]:
    """A report that never raises: pyverbs, devices, active ports, GPU (dma-buf) prerequisites."""
    report: dict[str, Any] = {"pyverbs": False, "devices": [], "gpu_direct": "unavailable"}
    try:
        dev = importlib.import_module("pyverbs.device")
        enums = importlib.import_module("pyverbs.enums")
    except ImportError as e:
        report["reason"] = (
            f"pyverbs cannot be imported ({e}): install rdma-core's Python bindings "
            "(Debian/Ubuntu: python3-pyverbs); the rdma transport is unavailable, tcp and "
            "shm work as before"
        )
        return report
    report["pyverbs"] = True
    try:
        for d in dev.get_device_list():
            name = d.name.decode()
            entry: dict[str, Any] = {"name": name, "ports": []}
            ctx = dev.Context(name=name)
            try:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    a = ctx.query_port(port)
                    entry["ports"].append(
                        {
                            "port": port,
                            "active": a.state == enums.IBV_PORT_ACTIVE,
                            "active_mtu": a.active_mtu,
                            "max_msg_sz": a.max_msg_sz,
                            "link_layer": (
                                "infiniband"
                                if a.link_layer == enums.IBV_LINK_LAYER_INFINIBAND
                                else "ethernet"
                            ),
                        }
                    )
            finally:
                ctx.close()
            report["devices"].append(entry)
    except Exception as e:  # a report, not a check: say what went wrong
        report["reason"] = f"querying devices failed: {e}"
    if not report["devices"]:
        report.setdefault("reason", "pyverbs imports but no RDMA device exists")
    report["gpu_direct"] = _gpu_direct()
    return report


def _gpu_direct() -> str:
    try:
        mr = importlib.import_module("pyverbs.mr")
    except ImportError:
        return "unavailable: no pyverbs"
    if not hasattr(mr, "DmaBufMR"):
        return "unavailable: this pyverbs has no DmaBufMR (rdma-core >= 34 needed)"
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")):
        return "unavailable: no NVIDIA GPU device nodes"
    return "possible but UNVERIFIED (see transfer/rdma_gpu.py and docs/rdma.md)"


if __name__ == "__main__":
    print(json.dumps(capabilities(), indent=2))
