"""An S3 endpoint whose GET replies stall after their header is in an outage like any other:
the read that hits its deadline is counted as the endpoint's trouble and opens one outage
episode (one warning, no traceback), later reads fail fast as misses instead of each waiting
``request_timeout_s``, and reads are served again once the endpoint answers.

The endpoint is `StallingS3Server` (tests/helpers/trickle_servers.py): a real HTTP server on
loopback that keeps what is PUT and, on demand, sends a GET's header and then no body byte.
moto's S3 server, which the other S3 tests run, cannot be made to stall mid-body. Both ways
of running the requests are tested: in a helper process and in the engine's process."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from helpers.tier_helpers import random_bytes, read, write
from helpers.trickle_servers import StallingS3Server

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.s3 import S3Tier  # noqa: E402 (after the skip)

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
BLOCK = 4096
SENTINEL = 0x5A
DEADLINE_S = 1.0
# (the shortest jittered wait before a probe is a tenth of it: 0.3 s, far more than a read
# that fails fast takes)
RETRY_S = 3.0


def sentinel() -> torch.Tensor:
    return torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)


@pytest.mark.parametrize("helper_process", [True, False], ids=["helper", "in-process"])
def test_a_stalled_s3_body_is_an_outage_whose_later_reads_fail_fast_until_it_answers(
        s3_credentials, caplog, helper_process):
    with StallingS3Server() as server:
        tier = S3Tier.from_options({
            "bucket": "bucket", "endpoint_url": server.endpoint_url, "bytes_to_use": 1 << 30,
            "refresh_interval_s": 0, "timeout_s": 5.0, "request_timeout_s": DEADLINE_S,
            "retry_interval_s": RETRY_S, "helper_process": helper_process}, FINGERPRINT)
        data = {k: random_bytes(BLOCK, seed) for seed, k in enumerate([b"a", b"b", b"c"])}
        for key, value in data.items():
            assert write(tier, [key], [value]).ok
        server.stalled.set()
        caplog.clear()

        out = sentinel()
        start = time.monotonic()
        assert read(tier, [b"a"], [out]).succeeded == (False,)
        took = time.monotonic() - start
        # (the per-read timeout is 5 s and the server holds the body back for 20 s: only
        # the 1 s deadline ends the read this early)
        assert DEADLINE_S * 0.9 < took < 4.0, f"the stalled read took {took:.1f} s"
        assert bool((out == SENTINEL).all())
        stats = tier.stats()
        assert stats["read_failed_unreachable"] == 1 and stats["outages"] == 1
        assert stats["read_failed_bug"] == 0
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "ReadTimeoutError" in warnings[0].getMessage()
        assert warnings[0].exc_info is None  # an outage, not a bug with a traceback

        gets = server.object_gets
        start = time.monotonic()
        assert read(tier, [b"b"], [out]).succeeded == (False,)
        took = time.monotonic() - start
        assert took < DEADLINE_S / 2, f"a read during the outage took {took:.1f} s"
        assert server.object_gets == gets  # not even sent
        assert tier.stats()["failed_fast"] == 1 and bool((out == SENTINEL).all())

        server.stalled.clear()
        end = time.monotonic() + RETRY_S + 5.0
        while not read(tier, [b"c"], [out]).ok:  # a miss until the next probe
            assert time.monotonic() < end, "reads were not served again after the stall"
            time.sleep(0.05)
        assert torch.equal(out, data[b"c"])
        assert tier.stats()["outages"] == 1
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == warnings
        tier.close()
