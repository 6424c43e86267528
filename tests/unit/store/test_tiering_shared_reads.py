"""Loads of the same storage-only keys at the same time share one read: every one of them
is served (before, the second found the key's host slot reserved by the first read and
failed, and both requests recomputed everything). Real files, real threads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv_offload.store.key_view import storage_key
from kv_offload.types import Location

from unit.store.test_tiering import NUM_BLOCKS, block_bytes, h, hybrid, make_store, wait_for_storage


@pytest.mark.parametrize("num_loads", [2, 5])
def test_concurrent_loads_of_one_disk_prefix_all_hit_with_one_read_per_key(tmp_path,
                                                                            num_loads):
    buffer, canonical = hybrid()
    keys = [h(i) for i in range(2)]
    expected = [block_bytes(canonical, 0, b) for b in (0, 1)]
    writer = make_store(canonical, tmp_path, slots=8)
    writer.wait([writer.submit_store({0: (keys, [0, 1])})])
    writer.flush()
    writer.close()
    buffer.zero_()
    reader = make_store(canonical, tmp_path, slots=8)  # a new process: the keys are on disk
    wait_for_storage(reader, [(k, 0) for k in keys])
    reads_before = reader.storage.stats()["read_ok"]
    # Each request loads the shared prefix into its own engine blocks, in one step.
    targets = [[2 + 2 * i, 3 + 2 * i] for i in range(num_loads)]
    assert max(max(t) for t in targets) < NUM_BLOCKS
    jobs = [reader.submit_load({0: (keys, t)}) for t in targets]
    results = reader.wait(jobs)
    assert [r.success for r in results] == [True] * num_loads
    for t in targets:
        for block, original in zip(t, expected):
            assert torch.equal(block_bytes(canonical, 0, block), original)
    assert reader.storage.stats()["read_ok"] - reads_before == len(keys)  # one read per key
    assert reader.lookup([(k, 0) for k in keys]) == [Location.HOST] * len(keys)
    reader.close()


def test_when_the_shared_read_fails_every_load_fails_that_block_only(tmp_path):
    buffer, canonical = hybrid()
    keys = [h(1), h(2)]
    good = block_bytes(canonical, 0, 2)
    writer = make_store(canonical, tmp_path, slots=8)
    writer.wait([writer.submit_store({0: (keys, [1, 2])})])
    writer.flush()
    writer.close()
    victim = next(p for p in Path(tmp_path).rglob("*.safetensors")
                  if storage_key((h(1), 0), writer.generation).hex() in p.name)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x40  # the data no longer matches its checksum
    victim.write_bytes(bytes(data))
    buffer.zero_()
    reader = make_store(canonical, tmp_path, slots=8)
    wait_for_storage(reader, [(k, 0) for k in keys])
    jobs = [reader.submit_load({0: (keys, [4 + 2 * i, 5 + 2 * i])}) for i in range(3)]
    results = reader.wait(jobs)
    assert [r.failed for r in results] == [{0: [4 + 2 * i]} for i in range(3)]
    assert all(torch.equal(block_bytes(canonical, 0, 5 + 2 * i), good) for i in range(3))
    reader.close()
