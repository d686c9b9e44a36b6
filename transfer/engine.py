"""The transfer engine: one registry, lazily loaded backends, channel choice.

The agent registers its pool once (`register`): every backend exposes the
same region under the same rkey, which is what the directory publishes. For a
peer, `open_channel` picks the best backend both sides offer: same-host
shared memory first, then RDMA, then TCP. Backends are imported only when a
configuration names them, so pyverbs or CUDA load only where chosen.

GPU memory goes through `register_device` (the `cuda` backend, same-host CUDA
IPC; docs/gpu.md) and is read through `open_device_channel`: it has its own
rkey and never takes part in the host-pool channel choice above.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvdir.transfer.base import Channel, PeerUnavailable, Region, Transport
from kvdir.transfer.memory import Registry, SharedMemory
from kvdir.transfer.paged import PagedLayout
from kvdir.transfer.rdma_support import RdmaOptions

PREFERENCE = ("shm", "rdma", "tcp")
"""Backend order for a peer that offers several (fastest first)."""

DEVICE_BACKENDS = ("cuda",)
"""Backends that expose GPU memory (`register_device`), never host pools."""
REGISTER_FIRST = "rdma"
"""Registered first: its memory registration issues the rkey every backend shares."""


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the backends are built from (each takes the part it needs)."""

    registry: Registry
    host: str
    shared: Sequence[SharedMemory]
    rdma: RdmaOptions | None
    tcp_tls: Any


def _tcp(o: BackendOptions) -> Transport:
    from kvdir.transfer.tcp import TcpTransport

    return TcpTransport(host=o.host, registry=o.registry, tls=o.tcp_tls)


def _shm(o: BackendOptions) -> Transport:
    if not o.shared:
        raise ValueError("the shm backend needs the pools' shared memory")
    from kvdir.transfer.shm import ShmTransport

    return ShmTransport(o.shared, registry=o.registry)


def _rdma(o: BackendOptions) -> Transport:
    try:
        from kvdir.transfer.rdma import RdmaTransport
    except ImportError as e:
        raise ValueError(
            f"the rdma backend needs pyverbs, which cannot be imported here ({e}); "
            "install rdma-core's Python bindings (Debian: python3-pyverbs) or drop "
            "'rdma' from transports (`python -m kvdir.transfer.rdma_support` reports what exists)"
        ) from e
    return RdmaTransport(o.rdma, registry=o.registry)


def _cuda(_o: BackendOptions) -> Transport:
    try:
        from kvdir.transfer.cuda_ipc import CudaIpcTransport
    except ImportError as e:
        raise ValueError(f"the cuda backend cannot be loaded here ({e})") from e
    return CudaIpcTransport()


_BACKENDS: dict[str, Callable[[BackendOptions], Transport]] = {
    "tcp": _tcp,
    "shm": _shm,
    "rdma": _rdma,
    "cuda": _cuda,
}
"""The backends by name; each module is imported only when its backend is chosen."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    name: str
    params: dict[str, str]


class TransferEngine:
    def __init__(
        self,
        backends: Sequence[str],
        host: str = "127.0.0.1",
        shared: Sequence[SharedMemory] = (),
        rdma: RdmaOptions | None = None,
        tcp_tls: Any = None,
    ) -> None:
        """`rdma`: options of the rdma backend (device, port, GID index, exchange);
        `tcp_tls`: a `transfer.tcp.TcpTls` to serve and read tcp over TLS."""
        unknown = [b for b in backends if b not in _BACKENDS]
        if unknown:
            raise ValueError(
                f"unknown transfer backends: {', '.join(unknown)} "
                f"(available: {', '.join(sorted(_BACKENDS))})"
            )
        self.registry = Registry()
        options = BackendOptions(self.registry, host, shared, rdma, tcp_tls)
        self.transports: dict[str, Transport] = {n: _BACKENDS[n](options) for n in backends}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self.transports)

    def register(self, memory: memoryview) -> Region:
        """Expose `memory` through every backend under one rkey."""
        order = sorted(
            (n for n in self.transports if n not in DEVICE_BACKENDS),
            key=lambda n: n != REGISTER_FIRST,
        )
        regions = {self.transports[n].register(memory) for n in order}
        assert len(regions) == 1, "backends disagree on a region"
        return regions.pop()

    def register_device(self, memory: object, layout: PagedLayout | None = None) -> Region:
        """Expose GPU memory (a CUDA tensor or array; `layout`: the paged KV layout
        it holds) through the cuda backend. Its rkey is its own, not the host pool's."""
        t = self.transports.get("cuda")
        if t is None:
            raise ValueError("GPU memory needs the 'cuda' transport")
        from kvdir.transfer.cuda_ipc import CudaIpcTransport

        assert isinstance(t, CudaIpcTransport)
        return t.register_device(memory, layout)

    def open_device_channel(self, offered: Sequence[Descriptor]) -> Channel:
        """A channel to a same-host peer's GPU regions (the cuda backend)."""
        t = self.transports.get("cuda")
        for d in offered:
            if d.name == "cuda" and t is not None:
                return t.connect(d.params)
        raise PeerUnavailable("the peer offers no GPU regions this node can read")

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor(n, t.descriptor()) for n, t in self.transports.items()]

    def open_channel(self, offered: Sequence[Descriptor]) -> tuple[str, Channel]:
        """A channel over the best backend both sides have; tries the next on failure."""
        by_name = {d.name: d for d in offered}
        errors = []
        for name in PREFERENCE:
            if name in by_name and name in self.transports:
                try:
                    return name, self.transports[name].connect(by_name[name].params)
                except PeerUnavailable as e:
                    errors.append(f"{name}: {e}")
        raise PeerUnavailable(
            "no common transport works: " + ("; ".join(errors) or "none offered in common")
        )

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
