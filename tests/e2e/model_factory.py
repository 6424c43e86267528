"""The tiny local model builders, for the e2e tests (they live in kv_offload.tiny_models)."""

from kv_offload.tiny_models import (  # noqa: F401
    BUILDERS,
    build_gemma3,
    build_granite_hybrid,
    build_llama,
    build_qwen3_next,
)
