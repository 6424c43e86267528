"""Other engines' writes and deletions reach the Valkey tier's view through keyspace
notifications within a poll, without the background refresh scanning the store; what the
notifications miss (a server that refuses CONFIG, events lost while unsubscribed) is
reconciled by the paced SCAN. Against real redis-servers on loopback."""

from __future__ import annotations

import logging
import time

import pytest

from helpers.servers import unique_name
from helpers.tier_helpers import random_bytes, write

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from kv_offload.backends.valkey import ValkeyTier  # noqa: E402 (after the skip)
from kv_offload.backends.valkey.local_server import LocalServer, server_binary  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
FILLER = 20_000  # other keys on the server: one pass of a 10-key SCAN takes ~2000 polls

pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH (apt-get install -y redis-server)")


@pytest.fixture
def server():
    with LocalServer(maxmemory="64mb") as s:
        yield s


def admin(server: LocalServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def fill(client: redis.Redis, n: int = FILLER) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.set(f"other-app:{i}", b"x")
    pipe.execute()


def make_tier(server: LocalServer, prefix: str, **options) -> ValkeyTier:
    return ValkeyTier.from_options({"url": server.url, "key_prefix": prefix,
                                    "refresh_interval_s": 0, **options}, FINGERPRINT)


def scans(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def until(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, what
        time.sleep(0.01)
    return time.monotonic() - start


def test_another_engines_writes_and_deletions_arrive_by_notification_not_by_scanning(server):
    client, prefix = admin(server), unique_name("feed") + ":"
    fill(client)
    writer = make_tier(server, prefix)
    reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=10)
    keys = [f"k{i}".encode() for i in range(5)]
    before = scans(client)
    assert write(writer, keys, [random_bytes(4096, i) for i in range(5)]).ok
    until(lambda: reader.lookup(keys) == [True] * 5, 5.0, "the writes never reached the view")
    assert sorted(reader.take_changes(10).added) == keys
    client.delete(writer._name(keys[0]))  # (as another engine's clear() or a user would)
    until(lambda: reader.lookup(keys[:1]) == [False], 5.0, "the deletion never reached it")
    # A whole SCAN of this server with COUNT 10 is ~2000 calls: the old refresh ran one per
    # interval. The paced one ran one page per poll, and never finished a pass.
    assert scans(client) - before < 200
    assert reader.stats()["scan_passes"] == 0 and reader.stats()["feed_events"] >= 6
    writer.close()
    reader.close()


def test_an_eviction_under_maxmemory_leaves_the_view_by_its_notification(server):
    client, prefix = admin(server), unique_name("evict") + ":"
    fill(client)
    client.config_set("maxmemory", "8mb")
    # (the filler is evicted too: a SCAN of one bucket per poll keeps a pass long)
    reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=1)
    writer = make_tier(server, prefix)
    keys = [f"k{i}".encode() for i in range(60)]  # 60 x 256 KiB: beyond 8 MB, evicting
    for key in keys:
        write(writer, [key], [random_bytes(256 << 10, len(key))])
    until(lambda: reader.stats()["feed_events"] >= 60, 10.0, "the writes never arrived")
    held = sum(1 for _ in client.scan_iter(match=prefix + "*"))
    until(lambda: sum(reader.lookup(keys)) <= held, 5.0, "evicted keys stayed in the view")
    assert held < len(keys)
    assert reader.stats().counts.get("keys_vanished", 0) == 0  # (no SCAN pass dropped them)
    writer.close()
    reader.close()


@pytest.mark.parametrize("refused", ["config", "channels"])
def test_a_server_refusing_notifications_falls_back_to_the_paced_scan_and_says_so_once(
        server, tmp_path, caplog, refused):
    client, prefix = admin(server), unique_name("acl") + ":"
    rules = ("&*", "+@all", "-config") if refused == "config" else ("resetchannels", "+@all")
    client.execute_command("ACL", "SETUSER", "kv", "on", ">kv-Pa55-word", "~*", *rules)
    secret = tmp_path / "password"
    secret.write_text("kv-Pa55-word\n")
    secret.chmod(0o600)
    writer = make_tier(server, prefix, keyspace_events=False)  # (it would enable them)
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=100,
                           username="kv", password_file=str(secret))
        keys = [f"k{i}".encode() for i in range(5)]
        assert write(writer, keys, [random_bytes(4096, i) for i in range(5)]).ok
        until(lambda: reader.lookup(keys) == [True] * 5, 10.0, "the paced SCAN never found them")
        client.delete(writer._name(keys[0]))
        until(lambda: reader.lookup(keys[:1]) == [False], 10.0, "a pass never dropped it")
    said = [r.getMessage() for r in caplog.records if "keyspace notifications" in r.getMessage()]
    assert len(said) == 1 and "paced SCAN" in said[0] and "kv-Pa55-word" not in said[0]
    assert reader.stats()["feed_events"] == 0 and reader.stats()["scan_passes"] >= 1
    assert not [r for r in caplog.records if r.exc_info]  # (no traceback, at start or later)
    if refused == "config":
        assert client.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
    writer.close()
    reader.close()


def test_events_missed_while_notifications_were_off_are_reconciled_by_the_paced_scan(server):
    client, prefix = admin(server), unique_name("missed") + ":"
    fill(client, 2000)
    writer = make_tier(server, prefix)
    old = [b"old"]
    assert write(writer, old, [random_bytes(4096, 9)]).ok
    reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=100)
    assert reader.lookup(old) == [True]
    client.config_set("notify-keyspace-events", "")  # (an operator, or a restart, turns it off)
    keys = [f"k{i}".encode() for i in range(5)]
    assert write(writer, keys, [random_bytes(4096, i) for i in range(5)]).ok
    client.delete(writer._name(old[0]))
    until(lambda: reader.lookup(keys + old) == [True] * 5 + [False], 20.0,
          "the paced SCAN did not reconcile the missed events")
    assert reader.stats()["scan_passes"] >= 1
    writer.close()
    reader.close()


def test_a_subscription_the_server_cut_is_counted_and_comes_back(server):
    client, prefix = admin(server), unique_name("cut") + ":"
    fill(client)
    writer = make_tier(server, prefix)
    reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=10,
                       retry_interval_s=0.1)
    assert client.client_kill_filter(_type="pubsub") >= 1
    until(lambda: reader.stats()["feed_gaps"] >= 1, 5.0, "the lost subscription went unseen")
    until(lambda: client.pubsub_numpat() >= 1, 5.0, "it never subscribed again")
    # A write made before the new subscription reaches the server is lost to it (pub/sub is
    # at most once: the crawl reconciles it), and the pattern count above can also be
    # redis-py's own short-lived re-subscription of the dead connection, which the feed
    # closes: so write until one is heard, each within a poll or two.
    start, heard = time.monotonic(), False
    for i in range(20):
        key = f"after-{i}".encode()
        assert write(writer, [key], [random_bytes(4096, 3)]).ok
        deadline = time.monotonic() + 0.5
        while not (heard := reader.lookup([key]) == [True]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if heard:
            break
    assert heard, f"the new subscription is deaf ({time.monotonic() - start:.1f} s of writes)"
    # (found by notification, not by the paced SCAN, which may adopt a key from a page)
    assert reader.stats()["feed_events"] >= 1, "found by the SCAN only: the subscription is deaf"
    assert reader.stats()["scan_passes"] == 0
    writer.close()
    reader.close()


def test_after_the_server_restarts_empty_notifications_are_turned_on_again(server):
    prefix = unique_name("restart") + ":"
    reader = make_tier(server, prefix, refresh_interval_s=0.05, scan_count=10,
                       retry_interval_s=0.1)
    server.kill()
    server.start()  # (same port, empty, notify-keyspace-events off again)
    client = admin(server)
    fill(client)
    until(lambda: client.config_get("notify-keyspace-events")["notify-keyspace-events"] != "",
          10.0, "the restarted server's notifications were never turned on again")
    until(lambda: client.pubsub_numpat() >= 1, 5.0, "it never subscribed again")
    writer = make_tier(server, prefix, keyspace_events=False)
    passes = reader.stats()["scan_passes"]  # (passes over the empty server end at once)
    assert write(writer, [b"after"], [random_bytes(4096, 4)]).ok
    until(lambda: reader.lookup([b"after"]) == [True], 5.0, "the new subscription is deaf")
    assert reader.stats()["feed_gaps"] >= 1 and reader.stats()["scan_passes"] == passes
    writer.close()
    reader.close()
