"""The tiny local model builders, for the e2e tests (they live in kv_offload.tiny_models)."""

from kv_offload.tiny_models import BUILDERS, build_gemma3, build_llama  # noqa: F401
