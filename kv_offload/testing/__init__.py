"""Fixtures for tests, benchmarks and the demo: engines' KV caches and models built locally.

Named after `numpy.testing` and `torch.testing`: code that helps check the library, shipped
with it so the tests, the benchmarks and `kv-offload demo` share one copy.

Contents:
- `engine_alloc`: allocate kv_caches the way vLLM does (one int8 buffer, per-layer strided
  views) in every supported physical layout (`LAYOUTS`, `allocate_kv_caches`).
- `example_models`: real models' KV-cache groups and specs (`EXAMPLE_MODELS`, `build_example`).
- `tiny_vocab`: the word-level vocabulary of the tiny models and prompts in it (`word_prompt`).
- `tiny_models`: tiny random-weight Hugging Face checkpoints vLLM can load (`build_llama`, ...).

Nothing in the library imports this package.
"""
