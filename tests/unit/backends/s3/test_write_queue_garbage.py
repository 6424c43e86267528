"""Writes queued behind a slow S3 endpoint cost the garbage collector little (issue 25).

A tier queues one task per block; when the store is slower than the engine's stores,
thousands wait, long enough to reach the old generation, and every full collection of the
engine's process walks them. With the tier's tasks on a ``ThreadPoolExecutor`` a queued
write held 18 tracked objects (a Future with its Condition and RLock, a work item, bound
methods, and the tier's own job and reservation); on `IoThreads`, 6 (a tuple and two bound
methods for the task). Measured against moto's server on loopback, paused (SIGSTOP) so that
the writes queue, then resumed: every write still lands.
"""

from __future__ import annotations

import gc
import signal
import time

import pytest
import torch

from helpers.servers import make_bucket

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.s3 import S3Tier  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"
WRITES = 2000
TRACKED_PER_QUEUED_WRITE_BOUND = 10  # (18 on a ThreadPoolExecutor; 6 now)


def test_a_queued_write_holds_few_tracked_objects_and_lands_once_the_store_answers(
        own_s3_server):
    tier = S3Tier.from_options({"bucket": make_bucket(own_s3_server.endpoint_url),
                                "endpoint_url": own_s3_server.endpoint_url,
                                "bytes_to_use": 1 << 30, "refresh_interval_s": 0,
                                "connections": 1, "timeout_s": 30, "request_timeout_s": 60},
                               FINGERPRINT)
    keys = [i.to_bytes(8, "big") * 4 for i in range(WRITES)]
    buffers = [torch.full((64,), i % 251, dtype=torch.uint8) for i in range(WRITES)]
    own_s3_server.process.send_signal(signal.SIGSTOP)  # (the first PUT waits: the rest queue)
    try:
        gc.collect()
        before = len(gc.get_objects())
        jobs = [tier.submit_write([key], [buf]) for key, buf in zip(keys, buffers)]
        gc.collect()
        per_write = (len(gc.get_objects()) - before) / WRITES
    finally:
        own_s3_server.process.send_signal(signal.SIGCONT)
    try:
        assert per_write < TRACKED_PER_QUEUED_WRITE_BOUND, per_write
        done: set[int] = set()
        deadline = time.monotonic() + 120
        while len(done) < len(jobs) and time.monotonic() < deadline:
            for result in tier.poll():
                assert all(result.succeeded), result
                done.add(result.job_id)
            time.sleep(0.01)
        assert done == set(jobs)
        assert tier.lookup(keys) == [True] * WRITES
    finally:
        tier.close()
