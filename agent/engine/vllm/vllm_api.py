"""What differs between the vLLM releases the connector supports, in one place.

The connector API of 0.24 (the CUDA release the H200 runs) and of 0.32/0.33
(CPU in CI) share their required methods and signatures; what 0.24 lacks is
named here once, each with the one fallback the connector uses instead:

- `KVConnectorTransferResults` / `get_transfer_results` (0.32+): 0.24 reports
  through `get_finished` and `get_block_ids_with_load_errors` only;
- `CacheHitSource` (0.32+, per-source hit metrics): 0.24 counts external hits
  without a source;
- `compute_layer_kv_cache_shape_bytes` (0.32+, the CPU backend's layer view);
- the scheduler output's `kv_connector_block_state` and the bound KV cache
  manager (0.32+): 0.24's connector follows each request's block table from
  the scheduler output itself (`plan.BlockTables`).

Imports vLLM: runs only inside vLLM's processes.
"""

from __future__ import annotations

import os
from typing import Any

import vllm

from kvdir.agent.engine.vllm import compat
from kvdir.transfer.kv_layout import predicted_order

SERIES = compat.check(vllm.__version__)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )
except ImportError:  # vLLM 0.24
    _TransferResults = None

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.24
    CacheHitSource = None

try:
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
except ImportError:  # vLLM 0.24
    compute_layer_kv_cache_shape_bytes = None

SEEDED_NONE_HASH = SERIES != "0.24"
"""vLLM 0.32+ seeds sha256 block hashes with a fixed default; 0.24 seeds every
hash algorithm randomly per process unless PYTHONHASHSEED is set, which would
make every engine's hashes its own: a silent 0% hit rate."""

HAS_TRANSFER_RESULTS = _TransferResults is not None
HAS_HIT_SOURCES = CacheHitSource is not None


def transfer_results(finished_recving: set[str]) -> Any:
    """vLLM's transfer results object (0.32+); the bare set where there is none."""
    if _TransferResults is None:
        return finished_recving
    return _TransferResults(finished_recving=finished_recving)


def hit_source(name: str) -> Any:
    """A CacheHitSource member by name, or None where vLLM has none."""
    return None if CacheHitSource is None else getattr(CacheHitSource, name)


def cpu_layer_view(spec: Any) -> tuple[int, int, int]:
    """(H, N, C-bytes) of the CPU backend's per-layer view (vLLM 0.32+)."""
    if compute_layer_kv_cache_shape_bytes is None:
        raise compat.UnsupportedVllm(
            f"kvdir connector: vLLM {vllm.__version__} on CPU is not supported "
            f"(CPU engines need vLLM 0.32 or 0.33)"
        )
    _, h, n, c_bytes = compute_layer_kv_cache_shape_bytes(spec, 1)
    return int(h), int(n), int(c_bytes)


REQUIRED_KV_CACHE_LAYOUT = "NHD"
"""What the connector asks vLLM for (`get_required_kvcache_layout`)."""


def cuda_cache_order() -> str:
    """The physical order of a CUDA engine's per-layer caches as the scheduler
    side predicts it (VLLM_KV_CACHE_LAYOUT overrides the connector's request,
    as it does inside vLLM); the worker checks the real strides against it."""
    return predicted_order(os.environ.get("VLLM_KV_CACHE_LAYOUT") or REQUIRED_KV_CACHE_LAYOUT)
