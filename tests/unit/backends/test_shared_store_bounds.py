"""Reads from shared stores are bounded in bytes and in time, whatever the store holds or how
slowly it answers: a planted oversized value costs no more memory than the read buffer, and a
server that trickles its reply costs one request deadline, not an I/O thread forever.
(Real redis-server and moto's S3 server on loopback; real trickling servers on loopback.)"""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

from helpers.servers import make_bucket, unique_name
from helpers.tier_helpers import random_bytes, read, wait, write
from helpers.trickle_servers import TrickleRespServer, TrickleS3Server

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.s3 import S3Tier  # noqa: E402 (after the skips)
from kv_offload.backends.valkey import ValkeyTier  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
BLOCK = 4096
PLANTED = 64 << 20  # what an attacker (or a bug) put under the key
SENTINEL = 0x5A


def peak_bytes_of(fn, *args):
    """(fn's result, the peak of Python allocations while it ran, in bytes: every thread)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def valkey_tier(url: str, **options) -> ValkeyTier:
    return ValkeyTier.from_options({"url": url, "key_prefix": unique_name("b") + ":",
                                    "refresh_interval_s": 0, **options}, FINGERPRINT)


def s3_tier(endpoint_url: str, bucket: str, **options) -> S3Tier:
    return S3Tier.from_options({"bucket": bucket, "endpoint_url": endpoint_url,
                                "bytes_to_use": 1 << 30, "refresh_interval_s": 0, **options},
                               FINGERPRINT)


def test_a_huge_junk_valkey_value_is_a_miss_that_costs_no_more_memory_than_the_buffer(
        valkey_server):
    tier = valkey_tier(valkey_server.url)
    server = redis.Redis.from_url(valkey_server.url)
    server.set(tier._name(b"k"), b"\xff" * PLANTED)
    out = torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)
    result, peak = peak_bytes_of(read, tier, [b"k"], [out])
    assert result.succeeded == (False,) and bool((out == SENTINEL).all())
    assert peak < 2 << 20, f"reading a 4 KiB block took {peak / 2**20:.0f} MiB"
    assert server.exists(tier._name(b"k")) == 0  # not ours: deleted
    assert tier.stats()["bad_values_removed"] == 1
    tier.close()


def test_an_intact_valkey_record_of_another_size_is_kept_and_read_only_up_to_the_buffer(
        valkey_server):
    tier = valkey_tier(valkey_server.url)
    big = random_bytes(PLANTED, 3)
    assert write(tier, [b"k"], [big]).ok
    del big
    out = torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)
    result, peak = peak_bytes_of(read, tier, [b"k"], [out])
    assert result.succeeded == (False,) and bool((out == SENTINEL).all())
    assert peak < 2 << 20, f"reading a 4 KiB block took {peak / 2**20:.0f} MiB"
    assert tier.stats()["read_failed_buffer_size"] == 1  # the caller's mistake: kept
    assert redis.Redis.from_url(valkey_server.url).exists(tier._name(b"k")) == 1
    small = random_bytes(BLOCK, 4)
    assert write(tier, [b"s"], [small]).ok  # a normal read is still served
    assert read(tier, [b"s"], [out]).ok and torch.equal(out, small)
    tier.close()


def test_a_huge_s3_object_is_a_miss_that_costs_no_more_memory_than_the_buffer(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    tier = s3_tier(s3_server.endpoint_url, bucket)
    boto3.client("s3", endpoint_url=s3_server.endpoint_url).put_object(
        Bucket=bucket, Key=tier._name(b"k"), Body=b"\xff" * PLANTED)
    tier.refresh()  # adopts it (another writer's object)
    assert tier.lookup([b"k"]) == [True]
    out = torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)
    result, peak = peak_bytes_of(read, tier, [b"k"], [out])
    assert result.succeeded == (False,) and bool((out == SENTINEL).all())
    assert peak < 2 << 20, f"reading a 4 KiB block took {peak / 2**20:.0f} MiB"
    assert tier.stats()["bad_objects_removed"] == 1 and tier.lookup([b"k"]) == [False]
    small = random_bytes(BLOCK, 5)
    assert write(tier, [b"s"], [small]).ok  # a normal read is still served
    assert read(tier, [b"s"], [out]).ok and torch.equal(out, small)
    tier.close()


def test_a_valkey_server_that_trickles_its_reply_costs_one_deadline_and_close_is_bounded():
    with TrickleRespServer(interval_s=0.2) as server:
        tier = valkey_tier(server.url, timeout_s=1.0, request_timeout_s=1.0)
        out = torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)
        start = time.monotonic()
        job = tier.submit_read([b"k"], [out])
        result = wait(tier, [job], timeout=30)[job]
        took = time.monotonic() - start
        assert server.trickle.trickles_started == 1  # it did read, and was trickled to
        assert result.succeeded == (False,) and bool((out == SENTINEL).all())
        # (the deadline is 1 s; without one the server trickles for 20 s: 8 s of slack for a
        # loaded CI machine still tells the two apart)
        assert took < 8.0, f"a trickled read took {took:.1f} s; the deadline is 1 s"
        assert tier.stats()["read_failed_unreachable"] == 1
        start = time.monotonic()
        tier.close()
        assert time.monotonic() - start < 2.5


def test_an_s3_endpoint_that_trickles_its_reply_costs_one_deadline_and_close_is_bounded(
        s3_credentials):
    with TrickleS3Server(interval_s=0.2) as server:
        tier = s3_tier(server.endpoint_url, "bucket", timeout_s=1.0, request_timeout_s=1.0)
        assert write(tier, [b"k"], [random_bytes(BLOCK, 6)]).ok  # (the server keeps nothing)
        out = torch.full((BLOCK,), SENTINEL, dtype=torch.uint8)
        start = time.monotonic()
        job = tier.submit_read([b"k"], [out])
        result = wait(tier, [job], timeout=30)[job]
        took = time.monotonic() - start
        assert server.trickle.trickles_started == 1
        assert result.succeeded == (False,) and bool((out == SENTINEL).all())
        # (the deadline is 1 s; without one the server trickles for 20 s: 8 s of slack for a
        # loaded CI machine still tells the two apart)
        assert took < 8.0, f"a trickled read took {took:.1f} s; the deadline is 1 s"
        start = time.monotonic()
        tier.close()
        assert time.monotonic() - start < 2.5
