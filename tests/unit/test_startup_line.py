"""The one line a worker rank logs once its tiers are open: what kv-offload set up."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from test_vllm_worker_side import Engine, make_worker  # noqa: E402


@pytest.mark.parametrize("with_disk", [False, True])
def test_each_rank_logs_its_tiers_sizes_directory_and_policy_once(tmp_path, caplog, with_disk):
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        worker = make_worker(Engine(), tmp_path if with_disk else None, rank=3)
    worker.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "kv-offload rank 3:")]
    assert len(lines) == 1
    assert "host tier 1.0 MiB" in lines[0] and "eviction lru" in lines[0]
    if with_disk:
        assert f"filesystem {tmp_path / 'kv'} (budget 64.0 MiB" in lines[0]
    else:
        assert lines[0].endswith("storage tier: none")
