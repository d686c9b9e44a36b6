"""KvdirConnector: vLLM's KVConnectorBase_V1, loaded out of tree by configuration.

    --kv-transfer-config '{"kv_connector": "KvdirConnector",
      "kv_connector_module_path": "kvdir.agent.vllm.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"agent_socket": "/run/kvdir/agent.sock"}}'

This adapter holds vLLM and translates: SchedulerSide (scheduler.py) plans,
WorkerSide (worker.py) moves bytes, AgentSeam (seam.py) talks to the agent.
Contracts kept (vllm/distributed/kv_transfer/kv_connector/v1/base.py):
get_num_new_matched_tokens is side-effect free for vLLM (it only caches a
lookup) and returns None while a lookup is pending; loads are asynchronous
(the request waits in WAITING_FOR_REMOTE_KVS, the forward pass never waits)
and their failed blocks are reported no later than the step
that reports the request finished receiving (on CUDA, loads from this host
are done inline in start_load_kv and reported by that same step: see
scheduler.py for why they are not vLLM's synchronous loads). Saves are
queued in wait_for_save and their slots announced only once the copies
completed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdir.agent.engine.vllm import vllm_api
from kvdir.agent.engine.vllm.config import (
    SAVE_RESERVE_SLOTS_MAX,
    ConnectorConfig,
    ConnectorConfigError,
    from_extra,
)
from kvdir.agent.engine.vllm.namespace import KvShape, NamespaceError, dtype_name, namespace
from kvdir.agent.engine.vllm.plan import BlockTables
from kvdir.agent.engine.vllm.scheduler import SchedulerSide, StepMeta
from kvdir.agent.engine.vllm.seam import AgentSeam, AgentUnavailable
from kvdir.agent.engine.vllm.stats import KvdirPromMetrics, KvdirStats, lookup_data, worker_data
from kvdir.agent.engine.vllm.step_timer import StepTimer
from kvdir.agent.engine.vllm.worker import Mover, WorkerSide

log = logging.getLogger("kvdir.vllm")


def _log_like_vllm() -> None:
    """kvdir's log lines go where vLLM's go (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("kvdir"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        ours.handlers = list(theirs.handlers)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_log_like_vllm()

UNSEEDED_ALGOS = ("xxhash", "xxhash_cbor")


@dataclass
class KvdirMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    step: StepMeta


def _check_vllm_config(vllm_config: Any) -> None:
    ktc = vllm_config.kv_transfer_config
    if ktc.kv_load_failure_policy != "recompute":
        raise ConnectorConfigError(
            'kvdir connector: set "kv_load_failure_policy": "recompute" (a block that fails '
            "validation must be recomputed, not fail the request)"
        )
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    random_seed = algo in UNSEEDED_ALGOS or not vllm_api.SEEDED_NONE_HASH
    if random_seed and os.environ.get("PYTHONHASHSEED") is None:
        raise ConnectorConfigError(
            f"kvdir connector: vLLM {vllm_api.SERIES} seeds {algo} block hashes randomly per "
            "process unless PYTHONHASHSEED is set (the same on every engine): set it"
        )


def expected_shape(kv_cache_config: Any, device: str) -> tuple[KvShape, list[str]]:
    """The KvShape of one block as the worker will move it, and the layer order.

    CPU: the backend's logical [B, H, N, C] layer views, row-major. CUDA: each
    layer's keys then values, each [N, H, C] in the physical order vLLM's CUDA
    backends use (predicted here; the worker checks the real strides)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NamespaceError(
            f"kvdir connector: {len(groups)} KV cache groups (hybrid models are not supported)"
        )
    spec = groups[0].kv_cache_spec
    dtype = spec.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = list(groups[0].layer_names)
    if device == "cuda":
        order = vllm_api.cuda_cache_order()
        dims = {"N": int(spec.block_size), "H": int(spec.num_kv_heads), "C": int(spec.head_size)}
        block = (2, *(dims[d] for d in order[2:]))
        shape = KvShape(len(layers), block, dtype_name(dtype), itemsize, device, order.lower())
        return shape, layers
    h, n, c_bytes = vllm_api.cpu_layer_view(spec)
    shape = KvShape(len(layers), (h, n, c_bytes // itemsize), dtype_name(dtype), itemsize, device)
    return shape, layers


def _model_name(cfg: ConnectorConfig, vllm_config: Any) -> str:
    if cfg.model:
        return cfg.model
    served = vllm_config.model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else ""
    return str(served or vllm_config.model_config.model)


class KvdirConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = vllm_api.hit_source("P2P")

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_vllm_config(vllm_config)
        self.cfg = from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_tokens = int(vllm_config.cache_config.block_size)
        device = str(vllm_config.device_config.device_type or "cpu")
        self.shape, self.layer_names = expected_shape(kv_cache_config, device)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        self.ns = namespace(
            _model_name(self.cfg, vllm_config), self.block_tokens, self.shape, tp_rank, tp_size
        )
        self.seam = AgentSeam(self.cfg, self.ns, self.shape.block_bytes)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._requests: dict[str, Any] = {}
        self._unloaded: set[str] = set()
        self._unloaded_blocks: set[int] = set()
        self._tables = BlockTables()
        self._disabled = ""
        """Why the worker side moves nothing (a refusal seen after start), or ""."""
        self._step_timer = StepTimer(self.shape.device == "cuda")
        if role == KVConnectorRole.SCHEDULER:
            self.sched = SchedulerSide(
                self.seam,
                self.cfg,
                self.block_tokens,
                self.shape.block_bytes,
                inline_device=self.shape.device == "cuda",
            )
        self._attach_early()
        log.info("kvdir connector ready", extra={"layout": self.ns.layout, "role": str(role)})

    def _attach_early(self) -> None:
        """A missing pool is a configuration error now; an absent agent is only a warning."""
        try:
            self.seam.attach()
        except AgentUnavailable as e:
            log.warning("kvdir agent unavailable; loading nothing until it answers: %s", e)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """CUDA caches in the layout the namespace names (VLLM_KV_CACHE_LAYOUT still wins)."""
        if str(vllm_config.device_config.device_type or "") == "cuda":
            return vllm_api.REQUIRED_KV_CACHE_LAYOUT
        return None

    # ================================================================ scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.sched is not None
        self._requests[request.request_id] = request
        tokens = self.sched.matched(
            request.request_id, request.block_hashes, request.num_tokens, num_computed_tokens
        )
        if tokens is None:
            return None, False
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self._requests[request.request_id] = request
        (ids,) = blocks.get_block_ids()
        self.sched.allocated(request.request_id, request.block_hashes, ids, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM 0.32+ only (0.24 counts external hits without a source)."""
        assert self.sched is not None
        pool, peer = self.sched.source_tokens(request.request_id)
        if pool + peer != num_external_tokens:
            return {vllm_api.hit_source("EXTERNAL_UNSPECIFIED"): num_external_tokens}
        out = {vllm_api.hit_source("HOST"): pool, vllm_api.hit_source("P2P"): peer}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        scheduled: dict[str, tuple[int, Any]] = {}
        n_sched = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            req = self._requests.get(r.req_id)
            if req is not None:
                scheduled[r.req_id] = (r.num_computed_tokens + n_sched[r.req_id], req.block_hashes)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is not None:
                done = cached.num_computed_tokens[i] + n_sched.get(req_id, 0)
                scheduled[req_id] = (done, req.block_hashes)
        step = self.sched.step(scheduled, self._block_ids(scheduler_output))
        step.tokens = int(scheduler_output.total_num_scheduled_tokens)
        return KvdirMetadata(step)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' measurements reach the pull-cost model here (scheduler side),
        and their ended loads the requests' timelines."""
        if self.sched is None:
            return
        self.sched.load_reported(getattr(connector_output, "finished_recving", None) or ())
        stats = getattr(connector_output, "kv_connector_stats", None)
        if not isinstance(stats, KvdirStats):
            return
        for nbytes, seconds in stats.data.get("peer_loads", ()):
            self.sched.cost.observe_load(int(nbytes), float(seconds))
        for tokens, seconds in stats.data.get("prefill_steps", ()):
            self.sched.cost.observe_prefill(int(tokens), float(seconds))

    def _block_ids(self, scheduler_output: Any) -> Any:
        """Where this step's requests' block tables come from: vLLM's own block
        state (0.32+), or (0.24) the tables followed from the scheduler output."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        manager = getattr(self, "_kv_cache_manager", None)
        if state is None and manager is None:
            for r in scheduler_output.scheduled_new_reqs:
                self._tables.new(r.req_id, r.block_ids[0])
            cached = scheduler_output.scheduled_cached_reqs
            resumed: set[str] = getattr(cached, "resumed_req_ids", set())
            for i, req_id in enumerate(cached.req_ids):
                new = cached.new_block_ids[i]
                self._tables.cached(req_id, new[0] if new else None, req_id in resumed)
            return self._tables.get

        def block_ids(req_id: str) -> list[int] | None:
            got = state.get_block_ids(req_id) if state is not None else None
            if got is None and manager is not None:
                got = manager.get_block_ids(req_id)
            return list(got[0]) if got else None

        return block_ids

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is not None:
            self.sched.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._tables.forget(request.request_id)
        return False, None

    # ================================================================== worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check the caches against the namespace and start the worker side: a
        mismatch or a pool this engine cannot use is refused here, in one line."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise NamespaceError(f"kvdir connector: no KV cache registered for {missing[:3]}")
        self._kv_caches = {n: kv_caches[n] for n in self.layer_names}
        if self.shape.device == "cuda":
            from kvdir.agent.engine.vllm.kvcopy_cuda import check_caches

            first = next(iter(self._kv_caches.values()))
            check_caches(list(self._kv_caches.values()), self.shape, self._num_blocks(first))
        else:
            from kvdir.agent.engine.vllm.kvcopy import shape_of

            got = shape_of(self._kv_caches, self.shape.device)
            if got != self.shape:
                raise NamespaceError(
                    f"kvdir connector: vLLM's KV caches are {got}, the config promised {self.shape}"
                )
        self._start_worker(refuse=True)

    def _reserve_slots(self) -> int:
        """Save slots kept reserved: at least what one step can complete, twice over
        (a step of max_num_batched_tokens fills that many blocks; fewer reserved
        slots would skip saving part of every long prefill), at most half the pool."""
        step_tokens = int(self._vllm_config.scheduler_config.max_num_batched_tokens)
        per_step = -(-step_tokens // self.block_tokens)
        want = max(self.cfg.save_reserve_slots, 2 * per_step)
        pool_half = self.seam.pool.geometry.slots // 2  # the rest holds what was saved
        return max(1, min(SAVE_RESERVE_SLOTS_MAX, want, pool_half))

    @staticmethod
    def _num_blocks(cache: torch.Tensor) -> int:
        return int(max(cache.shape[0], cache.shape[1]))

    def _mover(self) -> Mover:
        if self.shape.device == "cuda":
            from kvdir.agent.engine.vllm.kvcopy_cuda import CudaCopier

            layers = list(self._kv_caches.values())
            return CudaCopier(layers, self.shape, self.seam, self._num_blocks(layers[0]))
        from kvdir.agent.engine.vllm.kvcopy import BlockCopier

        return BlockCopier(self._kv_caches, self.shape, self.seam.pool)

    def _start_worker(self, refuse: bool = False) -> WorkerSide | None:
        """The worker side, started once the agent answers. A pool it cannot use
        is refused at start (`refuse`); found later (an agent restarted with
        another pool), it disables loading and saving: vLLM recomputes."""
        if self._disabled or self.worker is not None or not self._kv_caches:
            return self.worker
        if not self.seam.available():
            return None
        try:
            copier = self._mover()
        except AgentUnavailable:
            return None
        except NamespaceError as e:
            if refuse:
                raise
            self._disabled = str(e)
            log.error("kvdir connector disabled, vLLM recomputes: %s", e)
            return None
        self.worker = WorkerSide(self.seam, copier, self._reserve_slots(), self.cfg.save)
        if self.shape.device == "cuda":
            self.worker.engine_stream = int(torch.cuda.current_stream().cuda_stream)
        return self.worker

    def _meta(self) -> StepMeta | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.step if isinstance(meta, KvdirMetadata) else None

    def _renew_worker(self) -> None:
        """The agent replaced the pool file (a new epoch, agent/pool.py): the worker
        side and its seam are bound to the old one for good. Their unfinished loads
        are reported failed (vLLM recomputes); a new seam and worker map the new file."""
        old = self.worker
        if old is None or not old.seam.stale:
            return
        old.close()
        self._unloaded |= old.finished()
        self._unloaded_blocks |= old.take_errors()
        self.worker = None
        self.seam = AgentSeam(self.cfg, self.ns, self.shape.block_bytes)
        self._start_worker()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._renew_worker()
        step = self._meta()
        if step is None:
            return
        worker = self._start_worker() if step.loads else None
        for job in step.loads:
            if worker is None:  # no agent: report at once, vLLM recomputes
                self._unloaded.add(job.req_id)
                self._unloaded_blocks.update(job.block_ids)
            elif job.inline:
                worker.load_now(job)
            else:
                worker.submit(job)
        # Timed from here: an inline load is not prefill (the cost model's rate).
        self._step_timer.start(step.tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a loading request is not in the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved whole in wait_for_save, after the step's forward

    def wait_for_save(self) -> None:
        self._renew_worker()
        step = self._meta()
        if step is not None and step.saves and self.worker is not None:
            self.worker.save(step.saves)
        self._step_timer.stop()
        if self.worker is not None:
            for tokens, seconds in self._step_timer.done():
                self.worker.add_prefill_step(tokens, seconds)

    def _finished_recving(self) -> set[str]:
        done, self._unloaded = self._unloaded, set()
        if self.worker is not None:
            step = self._meta()
            done |= self.worker.finished(idle_step=step is not None and step.tokens == 0)
        return done

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+ (0.24 calls get_finished)."""
        return vllm_api.transfer_results(self._finished_recving())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._finished_recving() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._unloaded_blocks = self._unloaded_blocks, set()
        if self.worker is not None:
            errors |= self.worker.take_errors()
        return errors

    def get_kv_connector_stats(self) -> KvdirStats | None:
        if self.worker is not None:
            stats = KvdirStats(data=worker_data(self.worker.drain_stats()))
        elif self.sched is not None:
            counts = self.sched.counts
            stats = KvdirStats(data=lookup_data(counts))
            self.sched.counts = type(counts)()
        else:
            return None
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdirStats:
        return KvdirStats(data=data) if data is not None else KvdirStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvdirPromMetrics:
        return KvdirPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            self.sched.close()
        self.seam.close()
