"""The one line a worker rank logs once its tiers are open: what kv-offload set up."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from unit.vllm.worker.test_worker_side import Engine, make_worker  # noqa: E402


@pytest.mark.parametrize("with_disk", [False, True])
def test_each_rank_logs_its_tiers_sizes_directory_and_policy_once(tmp_path, caplog, with_disk):
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        worker = make_worker(Engine(), tmp_path if with_disk else None, rank=3)
    worker.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "kv-offload rank 3:")]
    assert len(lines) == 1
    assert "host tier 1.0 MiB" in lines[0] and "eviction slru" in lines[0]
    if with_disk:
        assert f"filesystem {tmp_path / 'kv'} (budget 64.0 MiB" in lines[0]
    else:
        assert "storage tier: none" in lines[0]
    assert lines[0].endswith("records unauthenticated (no secret_file: every writer of the "
                             "store is trusted, xxh3_64); whole-step loads and stores: "
                             "turned off (layer_wise: false)")


def start_up_line(root, caplog, **options) -> str:
    """Rank 0's start-up line for a worker over a disk tier in ``root`` (and ``options``)."""
    from kv_offload.config import OffloadConfig
    from kv_offload.vllm.worker.offload_worker import OffloadWorker

    worker = OffloadWorker(OffloadConfig(
        cpu_bytes_to_use=1 << 20, storage_tier="filesystem",
        storage_options={"root_dir": str(root), "bytes_to_use": 64 << 20}, **options), 0, "m")
    engine = Engine()
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        worker.register(engine.caches, engine.groups, 32)
    worker.shutdown()
    return next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("kv-offload rank 0:"))


def test_the_start_up_line_says_when_records_are_authenticated_or_encrypted(tmp_path, caplog):

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    for encrypt, expected in ((False, "records authenticated (secret_file, hmac_sha256)"),
                              (True, "records encrypted and authenticated (secret_file, "
                                     "aes256gcm)")):
        caplog.clear()
        line = start_up_line(tmp_path / f"kv{encrypt}", caplog, secret_file=str(secret),
                             encrypt=encrypt)
        assert f"{expected}; whole-step loads and stores" in line and "s" * 32 not in line


def test_the_start_up_line_says_when_records_are_compressed(tmp_path, caplog):
    pytest.importorskip("blosc2")
    line = start_up_line(tmp_path / "kv", caplog, compression="lossless")
    assert "xxh3_64), compressed (blosc2-lz4); whole-step loads and stores" in line
