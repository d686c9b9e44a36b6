"""kvdir inside vLLM: a KV connector that loads peers' prefixes into vLLM's paged KV blocks.

Configured on `vllm serve` alone (docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KvdirConnector",
      "kv_connector_module_path": "kvdir.agent.vllm.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"agent_socket": "/run/kvdir/agent.sock"}}'

connector  the thin KVConnectorBase_V1 adapter; the only module that holds vLLM
stats      vLLM's connector stats and Prometheus hooks (imports vLLM too)
vllm_api   what differs between the supported vLLM releases (0.24 CUDA, 0.32/0.33)
compat     which vLLM versions the connector knows (one clear line otherwise)
config     kv_connector_extra_config -> ConnectorConfig (every limit named there)
namespace  the kvdir namespace of an engine: model, dtype, block size, layout, TP
plan       pure scheduler-side planning: loadable tokens, blocks to save, pull vs recompute
scheduler  scheduler side: bounded asynchronous lookups, per-step metadata
seam       the handful of verbs the connector needs from the node agent
kvcopy     worker side, CPU: one gather/scatter per layer between vLLM blocks and pool slots
kvcopy_cuda  worker side, CUDA: one kernel per batch between vLLM blocks and the GPU tier
step_timer worker side: times prefill-sized forward passes (the pull-cost model's input)
worker     worker side: loads (validated, partial success normal) and saves

Nothing here imports vLLM or torch at package import; `connector`, `stats`,
`vllm_api`, `kvcopy`, `kvcopy_cuda` and `step_timer` do, and run only inside
vLLM's processes.
"""
