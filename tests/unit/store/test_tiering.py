"""TieredStore: host slots in front of the filesystem tier, on real files and threads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kv_offload import FullAttentionSpec, KVCacheGroup, MambaSpec, canonicalize
from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.config import parse_config
from kv_offload.store import tiered as tiering
from kv_offload.store.key_view import storage_key
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.types import Location

NUM_BLOCKS = 12


def hybrid(device: str = "cpu"):
    """Two overlaid groups (attention + padded Mamba), as a small hybrid engine."""
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    mamba = MambaSpec(32, ((3, 64), (4, 16, 16)), (torch.bfloat16, torch.float32),
                      page_size_padded=attn.page_size_bytes)
    groups = [KVCacheGroup(["a0", "a1"], attn), KVCacheGroup(["m0", "m1"], mamba)]
    buffer, caches = allocate_kv_caches(groups, NUM_BLOCKS, "LBHNC", device=device)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    return buffer, canonicalize(caches, groups, NUM_BLOCKS)


def block_bytes(canonical, group, block):
    return torch.cat([canonical.tensors[r.tensor_idx].tensor[block,
                      r.offset_bytes:r.offset_bytes + r.page_size_bytes]
                      for r in canonical.group_refs[group]]).clone()


def make_store(canonical, root, slots=4, **kw):
    slot = max(canonical.slot_bytes_per_block(g) for g in range(len(canonical.group_refs)))
    storage = None
    if root is not None:
        storage = FilesystemTier(FilesystemTierConfig(
            root_dir=str(root), layout_fingerprint=layout_fingerprint(canonical),
            bytes_to_use=1 << 30, rescan_interval_s=0))
    return TieredStore(canonical, slots * slot, storage=storage, **kw)


def h(i):
    return i.to_bytes(8, "little")


def wait_for_storage(store, keys, timeout=10.0):
    """Poll until the storage tier's change feed has shown these keys to the store."""
    deadline = time.monotonic() + timeout
    while store.lookup(keys) != [Location.STORAGE] * len(keys):
        assert time.monotonic() < deadline, "the storage tier never reported its keys"
        store.poll()
        time.sleep(0.002)


def test_store_then_load_from_host_is_bit_exact():
    buffer, canonical = hybrid()
    store = make_store(canonical, None, slots=8)
    expected = {(g, b): block_bytes(canonical, g, b) for g in (0, 1) for b in (1, 2, 5)}
    [stored] = store.wait([store.submit_store({0: ([h(1), h(2)], [1, 2]), 1: ([h(5)], [5])})])
    assert stored.success
    assert store.lookup([(h(1), 0), (h(5), 1), (h(5), 0)]) == \
        [Location.HOST, Location.HOST, Location.ABSENT]
    buffer.zero_()
    # Load into other blocks, out of order.
    [loaded] = store.wait([store.submit_load({0: ([h(2), h(1)], [7, 3]), 1: ([h(5)], [9])})])
    assert loaded.success and loaded.failed == {}
    assert torch.equal(block_bytes(canonical, 0, 3), expected[0, 1])
    assert torch.equal(block_bytes(canonical, 0, 7), expected[0, 2])
    assert torch.equal(block_bytes(canonical, 1, 9), expected[1, 5])
    store.close()


def test_evicted_from_host_is_loaded_from_disk(tmp_path):
    buffer, canonical = hybrid()
    store = make_store(canonical, tmp_path, slots=2)
    expected = block_bytes(canonical, 0, 0)
    store.wait([store.submit_store({0: ([h(0)], [0])})])
    store.flush()
    for i in range(1, 4):  # push h(0) out of the 2 host slots
        store.wait([store.submit_store({0: ([h(i)], [i])})])
        store.flush()
    assert store.lookup([(h(0), 0)]) == [Location.STORAGE]
    buffer.zero_()
    [loaded] = store.wait([store.submit_load({0: ([h(0)], [6])})])
    assert loaded.success
    assert torch.equal(block_bytes(canonical, 0, 6), expected)
    assert store.lookup([(h(0), 0)]) == [Location.HOST]  # read back into a slot
    store.close()


def test_a_new_store_on_the_same_directory_finds_everything(tmp_path):
    buffer, canonical = hybrid()
    first = make_store(canonical, tmp_path, slots=6)
    expected = [block_bytes(canonical, g, b) for g, b in ((0, 1), (1, 2))]
    first.wait([first.submit_store({0: ([h(1)], [1]), 1: ([h(2)], [2])})])
    first.flush()
    first.close()
    buffer.zero_()
    second = make_store(canonical, tmp_path, slots=6)  # fresh host tier, same disk
    wait_for_storage(second, [(h(1), 0), (h(2), 1)])
    [loaded] = second.wait([second.submit_load({0: ([h(1)], [4]), 1: ([h(2)], [8])})])
    assert loaded.success
    assert torch.equal(block_bytes(canonical, 0, 4), expected[0])
    assert torch.equal(block_bytes(canonical, 1, 8), expected[1])
    second.close()


def test_corrupt_file_fails_only_its_blocks(tmp_path):
    buffer, canonical = hybrid()
    first = make_store(canonical, tmp_path, slots=6)
    good = block_bytes(canonical, 0, 2)
    first.wait([first.submit_store({0: ([h(1), h(2)], [1, 2])})])
    first.flush()
    first.close()
    victim = next(p for p in Path(tmp_path).rglob("*.safetensors")
                  if storage_key((h(1), 0), first.generation).hex() in p.name)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x40
    victim.write_bytes(bytes(data))
    buffer.zero_()
    second = make_store(canonical, tmp_path, slots=6)
    wait_for_storage(second, [(h(1), 0), (h(2), 0)])
    [loaded] = second.wait([second.submit_load({0: ([h(1), h(2)], [5, 6])})])
    assert not loaded.success and loaded.failed == {0: [5]}
    assert torch.equal(block_bytes(canonical, 0, 6), good)
    assert not victim.exists()  # the bad file is removed
    assert second.lookup([(h(1), 0)]) == [Location.ABSENT]
    second.close()


def test_absent_keys_fail_and_a_full_pool_skips_what_does_not_fit():
    _, canonical = hybrid()
    store = make_store(canonical, None, slots=2)
    [loaded] = store.wait([store.submit_load({1: ([h(9)], [3])})])
    assert loaded.failed == {1: [3]}
    [stored] = store.wait([store.submit_store({0: ([h(1), h(2), h(3)], [1, 2, 3])})])
    assert not stored.success and stored.failed == {0: [3]} and stored.skipped == 1
    assert store.lookup([(h(1), 0), (h(2), 0), (h(3), 0)]) == \
        [Location.HOST, Location.HOST, Location.ABSENT]
    store.close()


def test_from_config_builds_both_tiers(tmp_path):
    _, canonical = hybrid()
    config = parse_config({"cpu_bytes_to_use": "8MiB", "storage_tier": "filesystem",
                           "storage_options": {"root_dir": str(tmp_path), "bytes_to_use": "64MiB"},
                           "eviction_policy": "arc"})
    store = TieredStore.from_config(canonical, config, layout_fingerprint(canonical, "tp0/1"))
    assert store.storage is not None and store.cpu.num_slots > 0
    store.close()
    assert os.listdir(tmp_path)


@pytest.mark.parametrize("extra", ["", "tp1/2"])
def test_fingerprint_depends_on_layout_and_extra(extra):
    _, canonical = hybrid()
    assert layout_fingerprint(canonical, extra) == layout_fingerprint(canonical, extra)
    assert layout_fingerprint(canonical, extra) != layout_fingerprint(canonical, extra + "x")


def test_reset_while_reading_from_disk_serves_nothing_old_and_deletes_nothing(tmp_path):
    """A reset between submitting a disk read and its completion: the load ends (the
    bytes it reads are still those of its keys, so it may succeed), nothing raises, and
    after the reset the old keys are never served although their files stay (other
    engines sharing the directory may use them; they age out under the budget)."""
    buffer, canonical = hybrid()
    first = make_store(canonical, tmp_path, slots=6)
    first.wait([first.submit_store({0: ([h(1), h(2)], [1, 2])})])
    first.flush()
    first.close()
    second = make_store(canonical, tmp_path, slots=6)
    wait_for_storage(second, [(h(1), 0), (h(2), 0)])
    job = second.submit_load({0: ([h(1), h(2)], [4, 5])})  # read into slots in flight
    second.reset()
    second.wait([job])
    assert second.lookup([(h(1), 0), (h(2), 0)]) == [Location.ABSENT] * 2
    [again] = second.wait([second.submit_load({0: ([h(1)], [6])})])
    assert not again.success and again.failed == {0: [6]}
    assert len(list(Path(tmp_path).rglob("*.safetensors"))) == 2
    second.close()


def test_fingerprint_changes_with_the_layer_order_and_the_file_format(monkeypatch):
    """Two models whose pages look alike but whose groups list their layers in another
    order (or an older file format) must never read each other's bytes as valid."""
    import kv_offload.store.tiered as tiering

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    fingerprints = []
    for names in (["a0", "a1"], ["a1", "a0"]):
        groups = [KVCacheGroup(names, attn)]
        _, caches = allocate_kv_caches(groups, NUM_BLOCKS, "LBHNC")
        fingerprints.append(layout_fingerprint(canonicalize(caches, groups, NUM_BLOCKS)))
    assert fingerprints[0] != fingerprints[1]
    _, canonical = hybrid()
    before = layout_fingerprint(canonical)
    monkeypatch.setattr(tiering, "FILE_FORMAT_VERSION", tiering.FILE_FORMAT_VERSION + 1)
    assert layout_fingerprint(canonical) != before


def protected_on_disk(store, keys):
    """Whether each key is in the filesystem index's protected segment."""
    lru = store.storage._index._lru
    return [storage_key(k, store.generation) in lru.protected for k in keys]


def test_protected_keys_are_kept_by_both_tiers_also_when_protected_in_flight(tmp_path):
    buffer, canonical = hybrid()
    store = make_store(canonical, tmp_path, slots=8)
    early, late, never = (h(1), 0), (h(2), 0), (h(3), 0)
    [done] = store.wait([store.submit_store({0: ([h(1), h(3)], [1, 3])})])
    assert done.success
    store.flush()  # (the write-throughs landed)
    store.poll()
    assert store.lookup([early, never]) == [Location.HOST] * 2
    store.protect([early])
    assert list(store.manager.policy.protected) == [early]
    assert protected_on_disk(store, [early, never]) == [True, False]
    # protected while its store is in flight: both tiers protect it once it lands
    job = store.submit_store({0: ([h(2)], [2])})
    store.protect([late])
    store.wait([job])
    store.flush()
    store.poll()
    assert list(store.manager.policy.protected) == [early, late]
    assert protected_on_disk(store, [early, late, never]) == [True, True, False]
    assert not store.stores.protect_on_write and not store.stores.protect_on_host
    store.close()


def test_a_prefix_protected_before_its_store_is_submitted_is_protected_when_it_lands(tmp_path):
    """Two requests asking for one prefix in the same step: the second's lookup protects
    keys whose store the first has not submitted yet. Remembered, at most
    PROTECT_PENDING_SLOTS x the host slots of them (the oldest forgotten first)."""
    buffer, canonical = hybrid()
    store = make_store(canonical, tmp_path, slots=2)
    limit = tiering.PROTECT_PENDING_SLOTS * store.cpu.num_slots
    store.protect([(h(100 + i), 0) for i in range(limit)])  # fills the memory...
    store.protect([(h(1), 0)])  # ...and this one pushes the oldest out
    assert len(store.stores.protect_on_host) == len(store.stores.protect_on_write) == limit
    [done] = store.wait([store.submit_store({0: ([h(100), h(1)], [1, 2])})])
    assert done.success
    store.flush()
    store.poll()
    assert list(store.manager.policy.protected) == [(h(1), 0)]
    assert protected_on_disk(store, [(h(1), 0), (h(100), 0)]) == [True, False]
    store.close()
