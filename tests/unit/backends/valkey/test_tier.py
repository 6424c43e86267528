"""The Valkey tier against a real server on loopback: faults are misses, never wrong bytes,
never a hang. (The contract every tier meets is in test_tier_suite.py.)"""

from __future__ import annotations

import logging
import signal
import time

import pytest
import torch

from helpers.servers import unique_name
from helpers.tier_helpers import random_bytes, read, write

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from kv_offload.backends.valkey import ValkeyTier  # noqa: E402 (after the skip)

FINGERPRINT = "llama|LBHNC|page=65536|tp1|rank0"
# Another model, same length: its header puts the data at the same offset, so only the
# fingerprint check can tell.
FOREIGN = "gemma|LBHNC|page=65536|tp1|rank0"
SENTINEL = 0x5A


def make_tier(server, fingerprint: str = FINGERPRINT, **options) -> ValkeyTier:
    opts = {"url": server.url, "key_prefix": unique_name("t") + ":", "refresh_interval_s": 0,
            **options}
    return ValkeyTier.from_options(opts, fingerprint)


def client(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def sentinel(n: int) -> torch.Tensor:
    return torch.full((n,), SENTINEL, dtype=torch.uint8)


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def test_a_key_deleted_between_lookup_and_read_is_a_miss_and_leaves_the_view(valkey_server):
    tier = make_tier(valkey_server)
    data = random_bytes(70_000, 1)
    assert write(tier, [b"k"], [data]).ok
    assert tier.lookup([b"k"]) == [True]
    client(valkey_server).delete(tier._name(b"k"))
    out = sentinel(70_000)
    assert read(tier, [b"k"], [out]).succeeded == (False,)
    assert bool((out == SENTINEL).all())
    assert tier.lookup([b"k"]) == [False]
    assert tier.stats()["read_failed_absent"] == 1
    assert tier.take_changes(10).removed == (b"k",)  # (added and removed: the latest wins)
    tier.close()


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_corrupted_value_is_a_miss_and_is_deleted(valkey_server, where):
    tier = make_tier(valkey_server)
    data = random_bytes(50_000, 2)
    assert write(tier, [b"k"], [data]).ok
    name, server = tier._name(b"k"), client(valkey_server)
    value = bytearray(server.get(name))
    value[-10 if where == "data" else 20] ^= 0x01  # one bit, server-side copy
    server.set(name, bytes(value))
    out = sentinel(50_000)
    assert read(tier, [b"k"], [out]).succeeded == (False,)
    # A bad header keeps the value out of the buffer; data that fails its digest was read
    # straight into it (as the filesystem tier reads), and is not served.
    assert where == "data" or bool((out == SENTINEL).all())
    assert server.exists(name) == 0 and tier.lookup([b"k"]) == [False]
    assert tier.stats()["bad_values_removed"] == 1
    assert write(tier, [b"k"], [data]).ok  # the key can be stored again
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)
    tier.close()


def test_a_value_written_under_another_fingerprint_is_a_miss(valkey_server):
    prefix = unique_name("shared") + ":"
    ours = make_tier(valkey_server, key_prefix=prefix)
    theirs = make_tier(valkey_server, key_prefix=prefix, fingerprint=FOREIGN)
    data = random_bytes(4096, 3)
    assert write(theirs, [b"k"], [data]).ok
    assert ours.lookup([b"k"]) == [False]  # another namespace: never even listed
    ours.refresh()
    assert ours.lookup([b"k"]) == [False]
    # Planted under our name (a namespace collision): the header still refuses it.
    server = client(valkey_server)
    server.set(ours._name(b"k"), server.get(theirs._name(b"k")))
    ours.refresh()
    assert ours.lookup([b"k"]) == [True]
    out = sentinel(4096)
    assert read(ours, [b"k"], [out]).succeeded == (False,)
    assert bool((out == SENTINEL).all()) and ours.lookup([b"k"]) == [False]
    assert read(theirs, [b"k"], [out]).ok and torch.equal(out, data)  # theirs untouched
    ours.close()
    theirs.close()


def test_keys_evicted_under_maxmemory_are_misses_and_served_keys_are_exact(own_valkey_server):
    tier = make_tier(own_valkey_server)  # the server has 8 MB, allkeys-lru
    values = {f"k{i}".encode(): random_bytes(1 << 20, 100 + i) for i in range(24)}
    for key, data in values.items():  # 24 MiB through an 8 MB server
        assert write(tier, [key], [data]).ok
    outs = {key: sentinel(1 << 20) for key in values}
    result = read(tier, list(values), list(outs.values()))
    served = [key for key, ok in zip(result.keys, result.succeeded) if ok]
    missed = [key for key, ok in zip(result.keys, result.succeeded) if not ok]
    assert served and len(missed) >= 16  # the server evicted at least two thirds
    assert all(torch.equal(outs[key], values[key]) for key in served)
    assert all(bool((outs[key] == SENTINEL).all()) for key in missed)
    assert tier.lookup(missed) == [False] * len(missed)
    memory = client(own_valkey_server).info("memory")
    assert memory["used_memory"] <= memory["maxmemory"] * 1.1
    tier.close()


def test_a_stalled_server_costs_at_most_the_timeout_then_jobs_fail_fast(own_valkey_server,
                                                                        caplog):
    tier = make_tier(own_valkey_server, timeout_s=0.3, retry_interval_s=1.0)
    data = random_bytes(100_000, 4)
    assert write(tier, [b"k"], [data]).ok
    client(own_valkey_server).client_pause(2500, all=True)
    out = sentinel(100_000)
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        result, first = timed(read, tier, [b"k"], [out])
        assert result.succeeded == (False,) and 0.25 < first < 1.5
        later, fast = timed(read, tier, [b"k"], [out])  # within retry_interval_s: no wait
        assert later.succeeded == (False,) and fast < 0.2
        assert not write(tier, [b"j"], [data]).ok
        assert bool((out == SENTINEL).all())
        time.sleep(2.6)  # the pause is over; the retry interval too
        assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failed" in warnings[0].getMessage()  # one per episode
    assert any("answers again" in r.getMessage() for r in caplog.records)
    stats = tier.stats()
    assert stats["outages"] == 1 and stats["failed_fast"] >= 2
    tier.close()


def test_a_server_killed_mid_read_gives_misses_at_once(own_valkey_server):
    tier = make_tier(own_valkey_server, timeout_s=5.0)
    keys = [f"k{i}".encode() for i in range(4)]
    values = [random_bytes(500_000, 10 + i) for i in range(4)]
    assert write(tier, keys, values).ok
    server = own_valkey_server.process
    server.send_signal(signal.SIGSTOP)  # the GETs are sent and wait for a reply...
    try:
        outs = [sentinel(500_000) for _ in keys]
        job = tier.submit_read(keys, outs)
        time.sleep(0.3)
        assert tier.poll() == []  # still waiting on the stopped server
    finally:
        server.send_signal(signal.SIGKILL)  # ...and the server dies before replying
        server.wait()
    deadline = time.monotonic() + 2.0  # well under the 5 s timeout: the reset ends it
    results = []
    while not results and time.monotonic() < deadline:
        results = tier.poll()
        time.sleep(0.01)
    assert [r.job_id for r in results] == [job] and results[0].succeeded == (False,) * 4
    assert all(bool((o == SENTINEL).all()) for o in outs)
    tier.close()


def test_the_tier_reconnects_to_a_restarted_server(own_valkey_server, caplog):
    tier = make_tier(own_valkey_server, retry_interval_s=0.2)
    old, new = random_bytes(8192, 5), random_bytes(8192, 6)
    assert write(tier, [b"old"], [old]).ok
    own_valkey_server.kill()
    assert not write(tier, [b"new"], [new]).ok  # refused: a miss, no exception
    own_valkey_server.start()  # same port, empty (nothing was saved)
    time.sleep(0.25)
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        assert write(tier, [b"new"], [new]).ok
    assert any("answers again" in r.getMessage() for r in caplog.records)
    out = torch.empty(8192, dtype=torch.uint8)
    assert read(tier, [b"new"], [out]).ok and torch.equal(out, new)
    assert tier.lookup([b"old"]) == [True]  # a stale hint until a read or a refresh
    tier.refresh()
    assert tier.lookup([b"old"]) == [False]
    assert read(tier, [b"old"], [out]).succeeded == (False,)
    tier.close()


def test_refresh_adopts_other_writers_and_the_change_feed_reports_it(valkey_server):
    prefix = unique_name("feed") + ":"
    writer = make_tier(valkey_server, key_prefix=prefix)
    reader = make_tier(valkey_server, key_prefix=prefix)
    assert len(reader.take_changes(10)) == 0  # nothing there yet
    keys = [f"k{i}".encode() for i in range(5)]
    assert write(writer, keys, [random_bytes(1000, i) for i in range(5)]).ok
    assert reader.lookup(keys) == [False] * 5  # lookups never touch the network
    reader.refresh()
    assert reader.lookup(keys) == [True] * 5
    first, rest = reader.take_changes(3), reader.take_changes(10)
    assert sorted(first.added + rest.added) == keys and len(first) == 3
    writer.clear()
    reader.refresh()
    assert reader.lookup(keys) == [False] * 5
    assert sorted(reader.take_changes(10).removed) == keys
    assert reader.stats()["keys_vanished"] == 5
    writer.close()
    reader.close()


def test_a_key_the_server_holds_is_not_sent_again(valkey_server):
    prefix = unique_name("skip") + ":"
    first, second = (make_tier(valkey_server, key_prefix=prefix) for _ in range(2))
    data = random_bytes(300_000, 7)
    assert write(first, [b"k"], [data]).ok
    assert write(second, [b"k"], [data]).ok  # EXISTS said yes: no SET
    assert second.stats()["write_skipped_present"] == 1 and second.stats()["write_ok"] == 0
    assert second.lookup([b"k"]) == [True]
    first.close()
    second.close()


def test_large_jobs_are_split_into_bounded_batches_and_stay_exact(valkey_server):
    tier = make_tier(valkey_server, batch_bytes=100_000, connections=3)
    keys = [f"k{i}".encode() for i in range(30)]
    values = [random_bytes(40_000 + i, 20 + i) for i in range(30)]
    assert write(tier, keys, values).ok
    outs = [torch.empty_like(v) for v in values]
    assert read(tier, keys, outs).ok
    assert all(torch.equal(o, v) for o, v in zip(outs, values))
    tier.close()


def test_a_server_down_at_start_is_a_logged_miss_not_an_error(caplog, tmp_path):
    from kv_offload.backends.valkey.local_server import free_port

    url = f"redis://user@127.0.0.1:{free_port()}/0"  # nothing listens there
    secret = tmp_path / "password"
    secret.write_text("secret\n")
    secret.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        tier, seconds = timed(ValkeyTier.from_options, {"url": url, "refresh_interval_s": 0,
                                                        "password_file": str(secret)},
                              FINGERPRINT)
    assert seconds < 2.0 and tier.lookup([b"k"]) == [False]
    assert not write(tier, [b"k"], [random_bytes(100, 8)]).ok
    assert read(tier, [b"k"], [sentinel(100)]).succeeded == (False,)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "127.0.0.1" in warning and "secret" not in warning  # no password in logs
    tier.close()


def test_a_key_another_engine_writes_shows_up_by_the_next_background_refresh(valkey_server):
    prefix = unique_name("shared") + ":"
    reader = make_tier(valkey_server, key_prefix=prefix, refresh_interval_s=0.05)
    writer = make_tier(valkey_server, key_prefix=prefix)
    assert reader.lookup([b"k"]) == [False]
    assert write(writer, [b"k"], [random_bytes(70_000, 2)]).ok
    deadline = time.monotonic() + 10
    while reader.lookup([b"k"]) != [True]:
        assert time.monotonic() < deadline, "the reader's background refresh never saw it"
        time.sleep(0.01)
    assert reader.take_changes(10).added == (b"k",)
    writer.close()
    reader.close()
