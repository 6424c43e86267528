"""The S3 tier against moto's S3 server on loopback (a correctness reference): faults are
misses, never wrong bytes, never a hang; the client enforces the byte budget.
(The contract every tier meets is in test_tier_suite.py.)"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from helpers.servers import make_bucket
from helpers.tier_helpers import random_bytes, read, write

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from kv_offload.backends.record import NETWORK_ALIGN, data_offset  # noqa: E402
from kv_offload.backends.s3 import S3Tier  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"
# Another model, same length: its header puts the data at the same offset, so only the
# fingerprint check can tell.
FOREIGN = "gemma|LBHNC|page=65536|tp1|rank0"
SENTINEL = 0x5A


def make_tier(server, bucket=None, fingerprint=FINGERPRINT, **options) -> S3Tier:
    opts = {"bucket": bucket or make_bucket(server.endpoint_url),
            "endpoint_url": server.endpoint_url, "bytes_to_use": 1 << 30,
            "refresh_interval_s": 0, **options}
    return S3Tier.from_options(opts, fingerprint)


def objects(server, bucket) -> dict[str, int]:
    s3 = boto3.client("s3", endpoint_url=server.endpoint_url)
    listing = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {obj["Key"]: obj["Size"] for obj in listing}


def sentinel(n: int) -> torch.Tensor:
    return torch.full((n,), SENTINEL, dtype=torch.uint8)


def test_an_object_deleted_after_lookup_is_a_miss(s3_server):
    tier = make_tier(s3_server)
    assert write(tier, [b"k"], [random_bytes(5000, 1)]).ok
    assert tier.lookup([b"k"]) == [True]
    boto3.client("s3", endpoint_url=s3_server.endpoint_url).delete_object(
        Bucket=tier.config.bucket, Key=tier._name(b"k"))
    out = sentinel(5000)
    assert read(tier, [b"k"], [out]).succeeded == (False,)
    assert bool((out == SENTINEL).all()) and tier.lookup([b"k"]) == [False]
    assert tier.stats()["read_failed_vanished"] == 1
    tier.close()


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_corrupt_object_is_a_miss_and_is_deleted(s3_server, where):
    tier = make_tier(s3_server)
    data = random_bytes(20_000, 2)
    assert write(tier, [b"k"], [data]).ok
    s3, bucket, name = boto3.client("s3", endpoint_url=s3_server.endpoint_url), \
        tier.config.bucket, tier._name(b"k")
    body = bytearray(s3.get_object(Bucket=bucket, Key=name)["Body"].read())
    body[-7 if where == "data" else 30] ^= 0x80
    s3.put_object(Bucket=bucket, Key=name, Body=bytes(body))
    out = sentinel(20_000)
    assert read(tier, [b"k"], [out]).succeeded == (False,)
    assert bool((out == SENTINEL).all())
    assert name not in objects(s3_server, bucket) and tier.lookup([b"k"]) == [False]
    assert write(tier, [b"k"], [data]).ok  # stored again, and served
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)
    tier.close()


def test_an_object_of_another_fingerprint_is_a_miss(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    ours = make_tier(s3_server, bucket)
    theirs = make_tier(s3_server, bucket, fingerprint=FOREIGN)
    assert write(theirs, [b"k"], [random_bytes(3000, 3)]).ok
    ours.refresh()
    assert ours.lookup([b"k"]) == [False]  # another namespace: not listed
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    s3.copy_object(Bucket=bucket, Key=ours._name(b"k"),
                   CopySource={"Bucket": bucket, "Key": theirs._name(b"k")})
    ours.refresh()
    out = sentinel(3000)
    assert ours.lookup([b"k"]) == [True]
    assert read(ours, [b"k"], [out]).succeeded == (False,)
    assert bool((out == SENTINEL).all()) and ours.lookup([b"k"]) == [False]
    ours.close()
    theirs.close()


def test_the_client_enforces_the_budget_with_lru_by_last_access(s3_server):
    size = 10_000
    record = data_offset(b"k0", FINGERPRINT, size, align=NETWORK_ALIGN) + size
    tier = make_tier(s3_server, bytes_to_use=3 * record + 100)  # room for three objects
    values = {f"k{i}".encode(): random_bytes(size, 30 + i) for i in range(5)}
    for key in [b"k0", b"k1", b"k2"]:
        assert write(tier, [key], [values[key]]).ok
    out = torch.empty(size, dtype=torch.uint8)
    assert read(tier, [b"k0"], [out]).ok  # k0 is now the most recent: k1 goes first
    assert write(tier, [b"k3"], [values[b"k3"]]).ok
    assert write(tier, [b"k4"], [values[b"k4"]]).ok
    assert tier.lookup(list(values)) == [True, False, False, True, True]
    stored = objects(s3_server, tier.config.bucket)
    assert sorted(stored) == sorted(tier._name(k) for k in (b"k0", b"k3", b"k4"))
    assert sum(stored.values()) <= tier.config.bytes_to_use == tier.stats().bytes_budget
    assert tier.stats().bytes_used == sum(stored.values())
    too_big = random_bytes(4 * record, 9)
    assert write(tier, [b"huge"], [too_big]).succeeded == (False,)  # never fits: refused
    assert tier.stats()["write_failed_budget"] == 1
    tier.close()


def test_an_engine_with_a_small_budget_serves_the_fleets_objects_and_deletes_none_of_them(
        s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    fleet = make_tier(s3_server, bucket)
    theirs = [f"fleet{i}".encode() for i in range(40)]
    for i, key in enumerate(theirs):
        assert write(fleet, [key], [random_bytes(2000, i)]).ok
    record = data_offset(b"mine00", FINGERPRINT, 2000, align=NETWORK_ALIGN) + 2000
    small = make_tier(s3_server, bucket, bytes_to_use=3 * record)  # lists at start
    assert small.lookup(theirs) == [True] * 40  # adopted: served...
    out = torch.empty(2000, dtype=torch.uint8)
    assert read(small, [b"fleet7"], [out]).ok and torch.equal(out, random_bytes(2000, 7))
    mine = [f"mine{i:02}".encode() for i in range(10)]
    for i, key in enumerate(mine):
        assert write(small, [key], [random_bytes(2000, 100 + i)]).ok
    small.refresh()
    stored = objects(s3_server, bucket)
    # ...and never evicted: only its own objects went, down to its budget.
    assert all(small._name(k) in stored for k in theirs)
    assert sorted(k for k in mine if small._name(k) in stored) == mine[-3:]
    assert small.stats().bytes_used <= 3 * record
    assert sorted(small.take_changes(1000).added) == sorted(theirs + mine[-3:])
    fleet.close()
    small.close()


def test_with_evict_others_a_sole_owner_keeps_the_whole_prefix_within_its_budget(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    before_restart = make_tier(s3_server, bucket)
    keys = [f"k{i}".encode() for i in range(6)]
    for i, key in enumerate(keys):
        assert write(before_restart, [key], [random_bytes(2000, i)]).ok
    before_restart.close()
    record = data_offset(b"k0", FINGERPRINT, 2000, align=NETWORK_ALIGN) + 2000
    owner = make_tier(s3_server, bucket, bytes_to_use=4 * record, evict_others=True)
    assert sum(owner.lookup(keys)) == 4
    assert len(objects(s3_server, bucket)) == 4  # the two oldest were deleted
    changes = owner.take_changes(100)
    assert sorted(changes.added) == sorted(k for k in keys if owner.lookup([k])[0])
    owner.close()


def test_an_object_already_stored_is_not_sent_again(s3_server):
    bucket = make_bucket(s3_server.endpoint_url)
    first, second = make_tier(s3_server, bucket), make_tier(s3_server, bucket)
    data = random_bytes(50_000, 4)
    assert write(first, [b"k"], [data]).ok
    assert write(second, [b"k"], [data]).ok  # If-None-Match: * answered 412
    assert second.stats()["write_skipped_present"] == 1 and second.stats()["write_ok"] == 0
    first.close()
    second.close()


def test_a_server_killed_mid_read_gives_misses_at_once(own_s3_server):
    tier = make_tier(own_s3_server, timeout_s=5.0, connections=2)
    keys = [f"k{i}".encode() for i in range(6)]
    values = [random_bytes(300_000, 40 + i) for i in range(6)]
    assert write(tier, keys, values).ok
    server = own_s3_server.process
    server.send_signal(signal.SIGSTOP)  # requests are sent and wait for a reply...
    try:
        outs = [sentinel(300_000) for _ in keys]
        job = tier.submit_read(keys, outs)
        time.sleep(0.3)
        assert tier.poll() == []
    finally:
        server.send_signal(signal.SIGKILL)  # ...and the server dies before replying
        server.wait()
    deadline = time.monotonic() + 3.0  # under the 5 s timeout: the reset ends it
    results = []
    while not results and time.monotonic() < deadline:
        results = tier.poll()
        time.sleep(0.01)
    assert [r.job_id for r in results] == [job] and results[0].succeeded == (False,) * 6
    assert all(bool((o == SENTINEL).all()) for o in outs)
    assert tier.stats()["outages"] == 1
    start = time.monotonic()
    assert not write(tier, [b"new"], [values[0]]).ok  # the endpoint is down: fails fast
    assert time.monotonic() - start < 0.5
    tier.close()


def test_a_stalled_endpoint_costs_at_most_the_timeout(own_s3_server):
    tier = make_tier(own_s3_server, timeout_s=0.5)
    data = random_bytes(10_000, 5)
    assert write(tier, [b"k"], [data]).ok
    own_s3_server.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        out = sentinel(10_000)
        assert read(tier, [b"k"], [out]).succeeded == (False,)
        assert time.monotonic() - start < 2.0 and bool((out == SENTINEL).all())
    finally:
        own_s3_server.process.send_signal(signal.SIGCONT)
    time.sleep(tier.config.retry_interval_s)
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)
    tier.close()


def test_an_endpoint_down_at_start_is_a_miss_not_an_error(s3_credentials):
    from kv_offload.backends.valkey.local_server import free_port

    start = time.monotonic()
    tier = S3Tier.from_options({"bucket": "nowhere", "bytes_to_use": 1 << 20,
                                "endpoint_url": f"http://127.0.0.1:{free_port()}",
                                "refresh_interval_s": 0}, FINGERPRINT)
    assert time.monotonic() - start < 3.0 and tier.lookup([b"k"]) == [False]
    assert not write(tier, [b"k"], [random_bytes(100, 8)]).ok
    assert tier.stats()["outages"] == 1
    tier.close()
