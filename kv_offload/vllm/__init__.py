"""kv-offload's vLLM integration: the only package that imports vllm.

vLLM loads the connector by name (`kv_connector_module_path: "kv_offload.vllm"`), and its
front-end stats logger imports this module too, so the connector is imported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadConnector":
        from kv_offload.vllm.connector import KVOffloadConnector

        return KVOffloadConnector
    raise AttributeError(f"module 'kv_offload.vllm' has no attribute {name!r}")
