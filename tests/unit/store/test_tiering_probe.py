"""A new TieredStore over a storage tier that already holds keys measures the tier's read
throughput before any load needs it (kv_offload.store.probe): a read of a few stored keys
into free host slots, then the slots are freed. Real files, real threads."""

from __future__ import annotations

import time

import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import data_offset
from kv_offload.store.jobs import Probe
from kv_offload.store.probe import RETRY_S, ROUNDS
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.types import Location

from unit.store.test_tiering import block_bytes, h, hybrid, make_store, wait_for_storage


def stored_directory(canonical, root, blocks):
    """Keys of `blocks` (group 0) written to disk by an engine that then went away."""
    first = make_store(canonical, root, slots=len(blocks))
    [stored] = first.wait([first.submit_store({0: ([h(b) for b in blocks], blocks)})])
    assert stored.success and first.flush()
    first.close()
    return [(h(b), 0) for b in blocks]


def poll_until_measured(store, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.read_rate.bytes_per_s == 0:
        assert time.monotonic() < deadline, "the store never measured its storage tier"
        store.poll()
        time.sleep(0.002)


def poll_for(store, seconds: float) -> None:
    """Poll as an engine's pump would, past the probe's retry interval."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        store.poll()
        time.sleep(0.002)


def reads(store) -> int:
    return store.storage.stats()["read_ok"]


def test_a_new_store_measures_its_storage_tier_before_any_load(tmp_path):
    buffer, canonical = hybrid()
    keys = stored_directory(canonical, tmp_path, [1, 2, 3, 4, 5, 6])
    expected = block_bytes(canonical, 0, 3)
    one_key = canonical.slot_bytes_per_block(0)
    restarted = make_store(canonical, tmp_path, slots=8, probe_bytes=3 * one_key)
    poll_until_measured(restarted)
    poll_for(restarted, (ROUNDS + 0.5) * RETRY_S)  # (the measured reads, a second apart)
    assert reads(restarted) == 1 + ROUNDS * 3  # one warm-up key, then probe_bytes' worth
    assert len(restarted.read_rate.samples) == 1 + ROUNDS
    # Measuring moved nothing: every key is still served from storage, all slots free.
    assert restarted.lookup(keys) == [Location.STORAGE] * len(keys)
    assert restarted.manager.num_free_slots == 8
    buffer.zero_()
    [loaded] = restarted.wait([restarted.submit_load({0: ([h(3)], [7])})])
    assert loaded.success and loaded.from_storage == 1
    assert torch.equal(block_bytes(canonical, 0, 7), expected)
    restarted.close()


def test_no_probe_when_it_is_off_or_the_host_tier_has_no_free_slot(tmp_path):
    _, canonical = hybrid()
    keys = stored_directory(canonical, tmp_path, [1, 2, 3])
    off = make_store(canonical, tmp_path, slots=4, probe_bytes=0)
    wait_for_storage(off, keys)
    poll_for(off, 1.5 * RETRY_S)
    assert reads(off) == 0 and off.read_rate.bytes_per_s == 0
    off.close()

    full = make_store(canonical, tmp_path, slots=2, probe_bytes=1 << 20)
    [stored] = full.wait([full.submit_store({0: ([h(8), h(9)], [8, 9])})])  # every slot
    assert stored.success and full.flush()  # (written through: evictable now)
    assert full.manager.num_free_slots == 0 and full.manager.num_evictable == 2
    wait_for_storage(full, keys)
    poll_for(full, 1.5 * RETRY_S)
    assert reads(full) == 0  # a probe never evicts a host key to make room
    assert full.lookup([(h(8), 0), (h(9), 0)]) == [Location.HOST] * 2
    full.close()


def test_a_corrupt_file_met_by_the_probe_is_rejected_and_forgotten(tmp_path):
    _, canonical = hybrid()
    (key,) = stored_directory(canonical, tmp_path, [4])
    store = make_store(canonical, tmp_path, slots=4, probe_bytes=1 << 20)
    name = _storage_name(store, key)
    path = store.storage.file_path(name)
    offset = data_offset(name, layout_fingerprint(canonical), canonical.slot_bytes_per_block(0))
    with open(path, "r+b") as f:  # flip one data byte: the checksum no longer matches
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    wait_for_storage(store, [key])
    deadline = time.monotonic() + 10
    while store.lookup([key]) != [Location.ABSENT]:
        assert time.monotonic() < deadline, "the probe never met the corrupt file"
        store.poll()
        time.sleep(0.002)
    assert store.storage.stats()["bad_files_removed"] == 1
    assert store.read_rate.bytes_per_s == 0  # nothing good was read: still no figure
    while store.manager.num_free_slots != 4:  # (the probe's slot returns when its job ends)
        assert time.monotonic() < deadline, "the probe's host slot was never given back"
        store.poll()
        time.sleep(0.002)
    [loaded] = store.wait([store.submit_load({0: ([key[0]], [6])})])
    assert not loaded.success and loaded.failed == {0: [6]}  # a recompute, never the bytes
    store.close()


def _storage_name(store, key) -> bytes:
    from kv_offload.store.key_view import storage_key

    return storage_key(key, store.generation)


def test_the_probe_reads_keys_held_only_in_storage_past_newer_host_copies(tmp_path):
    _, canonical = hybrid()
    keys = stored_directory(canonical, tmp_path, [1, 2, 3])
    store = make_store(canonical, tmp_path, slots=8, probe_bytes=1 << 20)
    store.probe.next_at = float("inf")  # (held until the host copies are the newest keys)
    wait_for_storage(store, keys)
    [stored] = store.wait([store.submit_store({0: ([h(8), h(9)], [8, 9])})])
    assert stored.success and store.flush()  # written through: the newest storage keys
    store.probe.next_at = 0.0
    poll_until_measured(store)
    assert reads(store) >= 1
    assert store.lookup(keys) == [Location.STORAGE] * 3


class HeldResults(FilesystemTier):
    """A filesystem tier whose finished jobs are handed over only once released."""

    hold = False

    def poll(self):
        return [] if self.hold else super().poll()


def test_a_load_of_a_key_the_probe_is_reading_shares_that_read(tmp_path):
    buffer, canonical = hybrid()
    stored_directory(canonical, tmp_path, [1, 2, 3])
    originals = {h(b): block_bytes(canonical, 0, b) for b in (1, 2, 3)}
    tier = HeldResults(FilesystemTierConfig(
        root_dir=str(tmp_path), layout_fingerprint=layout_fingerprint(canonical),
        bytes_to_use=1 << 30, rescan_interval_s=0))
    tier.hold = True
    store = TieredStore(canonical, 8 * canonical.slot_bytes_per_block(0), storage=tier,
                        probe_bytes=1 << 20)
    deadline = time.monotonic() + 10
    while not any(isinstance(r, Probe) for r in store.book.storage_jobs.values()):
        assert time.monotonic() < deadline, "the probe never started"
        store.poll()
        time.sleep(0.002)
    (probe,) = [r for r in store.book.storage_jobs.values() if isinstance(r, Probe)]
    (key,) = probe.keys  # (the warm-up read: one key)
    buffer.zero_()
    job = store.submit_load({0: ([key[0]], [7])})
    for _ in range(20):  # the load finds the key's slot being filled: it awaits that read
        store.poll()
    tier.hold = False
    [loaded] = store.wait([job])
    assert loaded.success and loaded.from_storage == 1  # (read for it, by the probe)
    assert torch.equal(block_bytes(canonical, 0, 7), originals[key[0]])
    assert store.lookup([key]) == [Location.HOST]  # kept for the load that awaited it
    store.close()


def test_engines_probe_only_where_a_storage_read_can_load_in_step(tmp_path):
    from kv_offload.canonical import canonicalize
    from kv_offload.config import parse_config
    from kv_offload.specs import FullAttentionSpec, KVCacheGroup
    from kv_offload.store.probe import PROBE_BYTES
    from kv_offload.testing.engine_alloc import allocate_kv_caches

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    groups = [KVCacheGroup(["a0", "a1"], spec)]
    _, caches = allocate_kv_caches(groups, 8, "LBHNC")
    one_group = canonicalize(caches, groups, 8)
    _, two_groups = hybrid()
    base = {"cpu_bytes_to_use": "8MiB", "storage_tier": "filesystem",
            "storage_options": {"root_dir": str(tmp_path), "bytes_to_use": "64MiB"}}
    cases = [(one_group, {}, PROBE_BYTES), (one_group, {"in_step_read_s": 0}, 0),
             (one_group, {"in_step_load_bytes": 0}, 0), (two_groups, {}, 0)]
    for canonical, extra, expected in cases:
        store = TieredStore.from_config(canonical, parse_config({**base, **extra}),
                                        layout_fingerprint(canonical))
        assert store.probe_bytes == expected, extra
        store.close()
