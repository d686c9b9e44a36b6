"""The vLLM connector's public module path, kept for users' configurations.

The connector lives in kvdir.agent.engine.vllm (code that runs inside the
engine's processes: agent/engine/). `vllm serve` configurations name
`"kv_connector_module_path": "kvdir.agent.vllm.connector"`; that path stays
valid through `connector` here, a re-export and nothing else (docs/vllm.md).
"""
