"""An example third-party tier (a dict in process memory): copy it to write your own."""

from kv_offload.backends.example.dict_tier import DictTier

__all__ = ["DictTier"]
