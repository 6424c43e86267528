"""The S3 tier's background listing is a crawl bounded per poll (issue 25): each poll lists
at most ``list_pages_per_refresh`` pages of 1000 objects, other writers' objects become
readable as the crawl passes them, and a finished pass drops the objects that vanished.
Against moto's S3 server on loopback."""

from __future__ import annotations

import time

import pytest

from helpers.servers import make_bucket

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.record import CHECKSUM  # noqa: E402
from kv_offload.backends.s3 import S3Tier  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"


def make_tier(server, bucket, **options) -> S3Tier:
    return S3Tier.from_options({"bucket": bucket, "endpoint_url": server.endpoint_url,
                                "bytes_to_use": 1 << 30, "refresh_interval_s": 0,
                                **options}, FINGERPRINT)


def put_objects(server, bucket, keys: list[bytes]) -> None:
    """Objects named as another writer's keys (a lookup only needs the name)."""
    s3 = boto3.client("s3", endpoint_url=server.endpoint_url)
    root = f"kv-offload/{CHECKSUM.namespace(FINGERPRINT)}/"
    for key in keys:
        s3.put_object(Bucket=bucket, Key=root + key.hex(), Body=b"x")


def test_each_poll_lists_a_bounded_number_of_pages_and_a_pass_finds_every_object(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    tier = make_tier(s3_server, bucket, list_pages_per_refresh=1)
    keys = sorted(i.to_bytes(4, "big") + b"k" for i in range(2500))  # (listed in this order)
    put_objects(s3_server, bucket, keys)
    tier.poll_listing()
    assert sum(tier.lookup(keys)) == 1000  # one page, and the next 1500 not yet
    assert tier.lookup(keys[:1000]) == [True] * 1000
    tier.poll_listing()
    assert sum(tier.lookup(keys)) == 2000
    tier.poll_listing()  # (the last page: the pass ends)
    assert tier.lookup(keys) == [True] * 2500
    assert tier.stats()["listing_pages"] == 1 + 3  # (the start-up listing: one empty page)
    tier.close()


def test_a_finished_pass_drops_the_objects_that_vanished_and_only_those(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    keys = sorted(i.to_bytes(4, "big") + b"k" for i in range(1500))
    put_objects(s3_server, bucket, keys)
    tier = make_tier(s3_server, bucket, list_pages_per_refresh=1)
    assert tier.lookup(keys) == [True] * 1500  # (the start-up listing is whole)
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    root = f"kv-offload/{CHECKSUM.namespace(FINGERPRINT)}/"
    for key in keys[:10] + keys[-10:]:
        s3.delete_object(Bucket=bucket, Key=root + key.hex())
    tier.poll_listing()
    assert tier.lookup(keys[:10]) == [True] * 10  # (a pass drops nothing before its end)
    tier.poll_listing()
    assert tier.lookup(keys[:10] + keys[-10:]) == [False] * 20
    assert tier.lookup(keys[10:-10]) == [True] * 1480
    tier.close()


def test_the_background_thread_polls_the_crawl(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    tier = make_tier(s3_server, bucket, refresh_interval_s=0.05)
    keys = [b"late-%d" % i for i in range(5)]
    put_objects(s3_server, bucket, keys)
    deadline = time.monotonic() + 10
    while tier.lookup(keys) != [True] * 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.lookup(keys) == [True] * 5
    tier.close()


def test_the_fast_timestamp_parser_reads_listings_and_headers_as_botocore_does():
    from botocore.utils import parse_timestamp as botocore_timestamp

    from kv_offload.backends.s3.client import parse_timestamp

    for text in ("2026-11-25T09:57:56.000Z", "2026-11-25T09:57:56Z",
                 "Wed, 25 Nov 2026 09:57:56 GMT", "2026-11-25T10:57:56.125+01:00"):
        assert parse_timestamp(text) == botocore_timestamp(text)
