"""benchmarks/s3_bucket_server.py (the pre-filled moto server of `bench_step_cost.py --tier
s3`): an `S3Tier` lists what it was filled with, page by page, reads its records back, and
its listing keeps up with later PUTs and deletes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e "
                                          "'.[dev]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from step_cost_s3 import BUCKET, ROOT, S3Writer, start_s3  # noqa: E402
from step_cost_shared import block_of  # noqa: E402

BLOCK_BYTES = 1024


def read_back(tier, key: bytes) -> torch.Tensor | None:
    buf = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    job = tier.submit_read([key], [buf])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in tier.poll():
            if result.job_id == job:
                return buf if all(result.succeeded) else None
        time.sleep(0.005)
    raise AssertionError("the read did not finish")


def test_the_tier_lists_every_object_the_server_was_filled_with_and_keeps_up_with_changes(
        s3_credentials):
    inventory = [os.urandom(32) for _ in range(2500)]  # 3 pages of 1000
    documents = set(inventory[:4])
    run = start_s3(inventory, documents, BLOCK_BYTES, pages_per_refresh=1)
    try:
        tier = run.tier
        assert run.server_notes["objects"] == len(inventory)
        assert all(tier.lookup(inventory))  # the start-up listing paged through all of them
        key = inventory[0]
        assert torch.equal(read_back(tier, key), block_of(key, BLOCK_BYTES))
        assert read_back(tier, inventory[-1]) is None  # filler: 1 byte, not a record

        new = os.urandom(32)
        assert S3Writer(run.where).write(new, block_of(new, BLOCK_BYTES))
        S3Writer(run.where)._s3.delete_object(Bucket=BUCKET, Key=ROOT + inventory[1].hex())
        assert tier.lookup([new]) == [False]  # (nothing listed yet)
        tier.refresh()  # a whole pass: the new object is listed, the deleted one dropped
        assert tier.lookup([new, inventory[1], inventory[2]]) == [True, False, True]
        assert torch.equal(read_back(tier, new), block_of(new, BLOCK_BYTES))
    finally:
        run.close()
