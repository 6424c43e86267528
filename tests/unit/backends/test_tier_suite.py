"""The contract every StorageTier must meet, run against each tier implementation.

Add a tier by adding a factory to TIER_FACTORIES (it gets the test's temporary directory and
pytest's request, to ask for a server fixture). The example DictTier
(kv_offload/backends/example), the filesystem tier (with O_DIRECT where the disk supports it,
and buffered), the Valkey tier on a real server and the S3 tier on moto's server run it all.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kv_offload.backends.example import DictTier
from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig, aligned_host_buffer
from kv_offload.errors import TierClosedError, TierRequestError

from helpers.servers import make_bucket, unique_name
from helpers.tier_helpers import drain_changes, random_bytes, read, wait, write


@dataclass
class StorePlace:
    """Where one test's tiers store: a directory, and a server's names (a key prefix, a
    bucket) made on first use and kept, so that every tier a factory opens for the same
    place shares one store (another server's tier over the same directory, server or
    bucket). ``own_servers``: a server of this test alone (to kill), not the session's."""

    root: Path
    request: pytest.FixtureRequest
    own_servers: bool = False
    names: dict[str, str] = field(default_factory=dict)

    def server(self, backend: str):
        return self.request.getfixturevalue(
            f"own_{backend}_server" if self.own_servers else f"{backend}_server")

    def name(self, stem: str, make=unique_name) -> str:
        if stem not in self.names:
            self.names[stem] = make(stem)
        return self.names[stem]


def _valkey(place: StorePlace, **options):
    from kv_offload.backends.valkey import ValkeyTier

    server = place.server("valkey")
    return ValkeyTier.from_options({"url": server.url, "key_prefix": place.name("suite") + ":",
                                    "refresh_interval_s": 0, **options}, "suite-layout")


def _s3(place: StorePlace, helper_process=True, **options):
    from kv_offload.backends.s3 import S3Tier

    server = place.server("s3")
    bucket = place.name("bucket", lambda stem: make_bucket(server.endpoint_url))
    return S3Tier.from_options({"bucket": bucket,
                                "endpoint_url": server.endpoint_url, "bytes_to_use": 1 << 30,
                                "refresh_interval_s": 0, "helper_process": helper_process,
                                **options},
                               "suite-layout")


# Every factory opens its tier with its background refresh off (rescan_interval_s and
# refresh_interval_s 0): what another tier stored after it started is then seen by `find`
# alone.
TIER_FACTORIES = {
    "dict": lambda place: DictTier(),
    "filesystem": lambda place: FilesystemTier(
        FilesystemTierConfig(str(place.root), "suite-layout", 1 << 30, rescan_interval_s=0)
    ),
    "filesystem-buffered": lambda place: FilesystemTier(
        FilesystemTierConfig(
            str(place.root), "suite-layout", 1 << 30, direct_io=False, rescan_interval_s=0
        )
    ),
    "valkey": _valkey,
    "s3": _s3,  # (its requests in a helper process, the default)
    "s3-in-process": lambda place: _s3(place, helper_process=False),
}
PRIVATE = {"dict"}  # tiers whose store is the instance itself: no other instance shares it
SIZES = [1, 100, 4096, 4097, 65536 + 3, 1 << 20]


@pytest.fixture(params=sorted(TIER_FACTORIES))
def place(request, tmp_path):
    return StorePlace(tmp_path / "tier", request)


@pytest.fixture
def tier(place):
    made = TIER_FACTORIES[place.request.param](place)
    yield made
    made.close()


@pytest.fixture
def other(place, tier):
    """A second tier over the same store as ``tier`` (another server's), opened after it."""
    if place.request.param in PRIVATE:
        pytest.skip(f"{place.request.param}: no other instance shares its store")
    made = TIER_FACTORIES[place.request.param](place)
    yield made
    made.close()


def test_roundtrip_is_bit_exact_into_aligned_and_offset_views(tier):
    keys = [f"key-{n}".encode() for n in SIZES]
    sources = []
    for i, n in enumerate(SIZES):
        buf = aligned_host_buffer(n)
        buf.copy_(random_bytes(n, i))
        sources.append(buf)
    assert write(tier, keys, sources).succeeded == (True,) * len(keys)
    assert tier.lookup(keys) == [True] * len(keys)

    aligned = [aligned_host_buffer(n) for n in SIZES]
    assert read(tier, keys, aligned).ok
    # Views at odd offsets inside one pool: the read must touch its view and nothing else.
    pool = torch.full((sum(SIZES) + 2 * len(SIZES) + 1,), 0xAB, dtype=torch.uint8)
    views, offset = [], 1
    for n in SIZES:
        views.append(pool[offset : offset + n])
        offset += n + 2
    assert read(tier, keys, views).ok
    for src, a, v in zip(sources, aligned, views):
        assert torch.equal(src, a) and torch.equal(src, v)
    untouched = torch.ones_like(pool, dtype=torch.bool)
    for v in views:
        start = v.data_ptr() - pool.data_ptr()
        untouched[start : start + v.numel()] = False
    assert bool((pool[untouched] == 0xAB).all())


def test_lookup_reports_each_key(tier):
    assert tier.lookup([b"a", b"b"]) == [False, False]
    assert write(tier, [b"b"], [random_bytes(64, 1)]).ok
    assert tier.lookup([b"a", b"b", b"c"]) == [False, True, False]


def test_an_absent_key_fails_alone(tier):
    data = {b"p1": random_bytes(5000, 1), b"p2": random_bytes(7000, 2)}
    assert write(tier, list(data), list(data.values())).ok
    out = [torch.zeros(5000, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8),
           torch.zeros(7000, dtype=torch.uint8)]
    result = read(tier, [b"p1", b"absent", b"p2"], out)
    assert result.succeeded == (True, False, True)
    assert result.failed_keys == (b"absent",)
    assert torch.equal(out[0], data[b"p1"]) and torch.equal(out[2], data[b"p2"])


def test_a_wrong_size_buffer_fails_alone_and_keeps_the_key(tier):
    a, b = random_bytes(8192, 1), random_bytes(3000, 2)
    assert write(tier, [b"a", b"b"], [a, b]).ok
    out_a, out_b = torch.zeros(8191, dtype=torch.uint8), torch.zeros(3000, dtype=torch.uint8)
    assert read(tier, [b"a", b"b"], [out_a, out_b]).succeeded == (False, True)
    assert torch.equal(out_b, b)
    assert tier.lookup([b"a"]) == [True]
    right = torch.zeros(8192, dtype=torch.uint8)
    assert read(tier, [b"a"], [right]).ok and torch.equal(right, a)


def test_many_jobs_in_flight_each_result_polled_once(tier):
    data = {f"k{i}".encode(): random_bytes(4096 * (1 + i % 3) + i, i) for i in range(40)}
    keys = list(data)
    job_ids = [tier.submit_write(keys[i : i + 4], [data[k] for k in keys[i : i + 4]])
               for i in range(0, 40, 4)]
    assert len(set(job_ids)) == len(job_ids)
    results = wait(tier, job_ids)
    assert all(r.ok for r in results.values())
    assert [k for j in job_ids for k in results[j].keys] == keys
    outs = {k: torch.empty_like(v) for k, v in data.items()}
    read_ids = [tier.submit_read([k], [outs[k]]) for k in keys]
    assert all(r.ok for r in wait(tier, read_ids).values())
    assert all(torch.equal(outs[k], data[k]) for k in keys)
    assert tier.poll() == []


def test_stored_bytes_do_not_follow_later_changes_of_the_source(tier):
    src = random_bytes(10000, 3)
    original = src.clone()
    assert write(tier, [b"k"], [src]).ok
    src.fill_(0)
    out = torch.empty(10000, dtype=torch.uint8)
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, original)


def test_int8_buffers_and_rewrites(tier):
    src = random_bytes(5000, 4).view(torch.int8)
    assert write(tier, [b"k"], [src]).ok
    assert write(tier, [b"k"], [src]).ok
    out = torch.empty(5000, dtype=torch.int8)
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, src)


BAD_REQUESTS = {
    "more keys than buffers": ([b"a", b"b"], [torch.zeros(4, dtype=torch.uint8)], "2 keys but 1"),
    "str key": (["a"], [torch.zeros(4, dtype=torch.uint8)], "non-empty bytes"),
    "empty key": ([b""], [torch.zeros(4, dtype=torch.uint8)], "non-empty bytes"),
    "duplicate key": ([b"a", b"a"], [torch.zeros(4, dtype=torch.uint8)] * 2, "twice"),
    "float buffer": ([b"a"], [torch.zeros(4)], "dtype is torch.float32"),
    "2-D buffer": ([b"a"], [torch.zeros(2, 2, dtype=torch.uint8)], "shape is (2, 2)"),
    "empty buffer": ([b"a"], [torch.zeros(0, dtype=torch.uint8)], "empty"),
    "strided buffer": ([b"a"], [torch.zeros(8, dtype=torch.uint8)[::2]], "not contiguous"),
    "numpy buffer": ([b"a"], [torch.zeros(4, dtype=torch.uint8).numpy()], "got ndarray"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_raise_a_typed_error_naming_the_problem(tier, case):
    keys, bufs, expected = BAD_REQUESTS[case]
    for submit in (tier.submit_write, tier.submit_read):
        with pytest.raises(TierRequestError, match=re.escape(expected)):
            submit(keys, bufs)
    assert tier.poll() == []


def test_lookup_rejects_keys_that_are_not_bytes(tier):
    with pytest.raises(TierRequestError, match="key 1"):
        tier.lookup([b"ok", 42])


def test_close_keeps_results_and_refuses_new_jobs(tier):
    job = tier.submit_write([b"k"], [random_bytes(100, 5)])
    tier.close()
    tier.close()
    assert [r.job_id for r in tier.poll()] == [job]
    with pytest.raises(TierClosedError):
        tier.submit_write([b"j"], [random_bytes(100, 6)])
    with pytest.raises(TierClosedError):
        tier.submit_read([b"k"], [torch.empty(100, dtype=torch.uint8)])


# -- find: the store asked about named keys (issue 46) -------------------------------------


def test_find_sees_a_key_another_tier_stored_and_adopts_it(tier, other):
    """`other` stands for another server over the same store, opened before `tier` wrote:
    its refresh is off, so only `find` can tell it of the key."""
    data = random_bytes(5000, 7)
    drain_changes(other)
    assert write(tier, [b"theirs"], [data]).ok
    assert other.lookup([b"theirs", b"nobody"]) == [False, False]
    assert other.find([b"theirs", b"nobody"]) == [True, False]
    assert other.lookup([b"theirs", b"nobody"]) == [True, False]
    assert drain_changes(other) == ({b"theirs"}, set())  # adopted as a refresh adopts
    out = torch.empty(5000, dtype=torch.uint8)
    assert read(other, [b"theirs"], [out]).ok and torch.equal(out, data)
    assert other.find([b"theirs"]) == [True]  # (asked again: nothing new to report)
    assert drain_changes(other) == (set(), set())


def test_find_answers_for_own_keys_and_adopts_no_absent_key(tier):
    data = random_bytes(3000, 8)
    assert write(tier, [b"mine"], [data]).ok
    drain_changes(tier)
    assert tier.find([b"mine", b"nobody"]) == [True, False]
    assert tier.lookup([b"mine", b"nobody"]) == [True, False]
    assert drain_changes(tier) == (set(), set())
    assert tier.find([]) == []
    with pytest.raises(TierRequestError, match="key 1"):
        tier.find([b"ok", 42])


SHARED = ["valkey", "s3"]


@pytest.mark.parametrize("how", ["killed", "stalled"])
@pytest.mark.parametrize("backend", SHARED)
def test_find_during_an_outage_answers_from_the_view_within_the_deadline(
        backend, how, request, tmp_path):
    """A server down (connections refused) or stalled (SIGSTOP: requests sent, no reply):
    `find` answers from the view, by the request deadline, without raising; while the
    outage lasts later calls do not wait at all."""
    place = StorePlace(tmp_path, request, own_servers=True)
    bounds = {"timeout_s": 0.5, "request_timeout_s": 1.0, "retry_interval_s": 60.0}
    tier = _valkey(place, **bounds) if backend == "valkey" else _s3(place, **bounds)
    assert write(tier, [b"held"], [random_bytes(2000, 9)]).ok
    process = place.server(backend).process
    try:
        if how == "killed":
            place.server(backend).kill()
        else:
            process.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert tier.find([b"held", b"nobody"]) == [True, False]
        assert time.monotonic() - start < 1.0 + 0.5  # the deadline, and scheduling slack
        assert tier.stats()["outages"] == 1
        start = time.monotonic()
        assert tier.find([b"held", b"nobody"]) == [True, False]
        assert time.monotonic() - start < 0.2  # the outage: not asked again
        assert tier.lookup([b"nobody"]) == [False]
    finally:
        if how == "stalled":
            process.send_signal(signal.SIGCONT)
    tier.close()
