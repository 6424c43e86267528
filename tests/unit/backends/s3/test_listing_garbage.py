"""The S3 tier's listing leaves little in the garbage collector's old generation (issue 25).

In CPython 3.11 a full collection, which stops every thread of the engine's process for as
long as it takes to walk every tracked object not frozen, runs once the objects promoted
into the old generation since the last one exceed a quarter of those it holds. botocore
parses a listing reply into an element tree (twice: once to see whether a 200 hides an
error) and then a dict per object; at 1000 objects per request, with the reply held while
the next one was parsed, 4.5 to 14 objects per object listed reached the old generation
(13 to 14 here), and a crawl of ten pages a second set off a full collection every ~20 s in
the step-cost benchmark (9 per 1000 steps, up to 0.3 s each). Requests of 50 objects (whose
parse stays under the young generation's threshold), each reduced to bytes and numbers
before the next one, promote ~0.03 per object listed.

Measured here around real listing requests to moto's server on loopback (another process):
the growth of the old generation across each generation-1 collection that ran meanwhile.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.servers import make_bucket

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.record import CHECKSUM  # noqa: E402
from kv_offload.backends.s3 import S3Tier  # noqa: E402
from kv_offload.errors import ConfigError  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"
OBJECTS = 3000
PROMOTED_PER_OBJECT_BOUND = 1.0  # (4.5 to 9 before the fix; ~0.03 after)


def promoted_during(work: Callable[[], None]) -> int:
    """Objects that generation-1 collections moved into the old generation while ``work``
    ran (what counts towards the next full collection)."""
    promoted = before = 0

    def watch(phase: str, info: dict) -> None:
        nonlocal promoted, before
        if info["generation"] != 1:
            return
        held = len(gc.get_objects(generation=2))
        if phase == "start":
            before = held
        else:
            promoted += held - before

    gc.collect()  # (every count at zero: the same start whatever ran before)
    gc.callbacks.append(watch)
    try:
        work()
    finally:
        gc.callbacks.remove(watch)
    return promoted


@pytest.fixture(scope="module")
def filled_bucket(s3_server) -> str:
    """A bucket holding OBJECTS objects named as another writer's keys."""
    bucket = make_bucket(s3_server.endpoint_url)
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    root = f"kv-offload/{CHECKSUM.namespace(FINGERPRINT)}/"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=bucket, Key=f"{root}{i:064x}", Body=b"x"),
                      range(OBJECTS)))
    return bucket


def make_tier(server, bucket: str, **options) -> S3Tier:
    return S3Tier.from_options({"bucket": bucket, "endpoint_url": server.endpoint_url,
                                "bytes_to_use": 1 << 30, "refresh_interval_s": 0,
                                **options}, FINGERPRINT)


def test_the_start_up_listing_asks_for_a_thousand_objects_per_request(s3_server,
                                                                   filled_bucket):
    # (the whole listing is the tier's start-up: before the engine serves and before vLLM
    # freezes its heap; its round trips are the start-up's time)
    tier = make_tier(s3_server, filled_bucket)
    try:
        assert len(tier.keys()) == OBJECTS
        assert tier.stats()["listing_requests"] == OBJECTS // 1000
    finally:
        tier.close()


def test_the_crawl_promotes_few_objects_to_the_old_generation(s3_server, filled_bucket):
    tier = make_tier(s3_server, filled_bucket, list_pages_per_refresh=1)
    try:
        pages = OBJECTS // 1000

        def crawl() -> None:
            for _ in range(pages):
                tier.poll_listing()

        promoted = promoted_during(crawl)
        assert tier.stats()["listing_pages"] == 2 * pages  # (start-up listing, then the crawl)
        assert promoted / OBJECTS < PROMOTED_PER_OBJECT_BOUND, promoted
    finally:
        tier.close()


@pytest.mark.parametrize(("chosen", "requests_per_page"), [(None, 20), (1000, 1), (250, 4)])
def test_an_operator_chooses_how_many_objects_a_listing_request_asks_for(
        s3_server, filled_bucket, chosen, requests_per_page):
    # (AWS bills listing requests: list_request_objects 1000 sends 20x fewer than the
    # default, which stays under the young generation's threshold)
    tier = make_tier(s3_server, filled_bucket, list_request_objects=chosen)
    try:
        before = tier.stats()["listing_requests"]
        for _ in range(OBJECTS // 1000):
            tier.poll_listing()  # (the crawl: one page per poll)
        assert tier.stats()["listing_requests"] - before == OBJECTS // 1000 * requests_per_page
        assert len(tier.keys()) == OBJECTS
    finally:
        tier.close()


def test_a_listing_request_larger_than_s3_allows_is_refused_at_start(s3_server, filled_bucket):
    with pytest.raises(ConfigError, match="list_request_objects must be at most 1000"):
        make_tier(s3_server, filled_bucket, list_request_objects=5000)
