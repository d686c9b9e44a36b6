"""Re-export of kvdir.agent.engine.vllm.connector.KvdirConnector under its public path.

Users' `kv_connector_module_path` is "kvdir.agent.vllm.connector" (docs/vllm.md);
the code moved to agent/engine/vllm/ with the rest of the engine side. Importing
this module imports vLLM and torch, as the connector does.
"""

from kvdir.agent.engine.vllm.connector import KvdirConnector

__all__ = ["KvdirConnector"]
