"""Code that runs inside an inference engine's processes, apart from the agent daemon.

client     the engine library (kvdir.v1.Engine over the agent's Unix socket, the
           pool mapped read-write): allocate, stored/removed, lookup, fetch
gpu_kv     an engine's mapping of the agent's GPU tier over CUDA IPC, and the
           batched mover between vLLM's caches and it
vllm/      the vLLM KV connector (KvdirConnector; public path kvdir.agent.vllm.connector)

Rule (checked by tests/unit/test_engine_imports.py): nothing here imports the
daemon's modules (daemon, service, publisher, fetcher, holders, metrics,
config, ...). What both sides need lives in one home each, importable from
here: the pool format (agent/pool.py, agent/pool_file.py, agent/owners.py),
the GPU tier's slot helpers (agent/gpu_pool.py), the shared bounds
(agent/limits.py).
"""
