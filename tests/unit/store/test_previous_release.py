"""A store written before issue 44's layout is served after it: the disk-tier directories in
tests/fixtures/previous_release were written by the tree before it (commit dc15602; how:
write.py there), plain and encrypted, and today's tree reads every block back byte for
byte into other engine blocks. The record format, the layout fingerprint and the key
names did not change with the folders; if one does, this fails (the keys are not found,
or are found and rejected).

That release kept no generation record for a store that was never reset (its keys were in
the first generation). Today a store without one starts a fresh generation, since a
missing record may have been deleted or evicted after a reset (docs/security.md, "Resets
survive restarts"): an upgraded store starts cold once, which the second test shows. The
first plants the record an operator's fleet would hold (the first generation, sealed as
today's tree seals it) to check that everything else still reads as it did."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from kv_offload.backends.common.sealing import make_codec
from kv_offload.backends.filesystem.fileformat import GENERATION_NAME
from kv_offload.canonical import canonicalize
from kv_offload.config import parse_config
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.store.generations import generation_record
from kv_offload.store.key_view import FIRST_GENERATION
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.types import Location

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "previous_release"
# The writer's model and data (write.py): keep them in step.
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 8
HASHES = [f"old-{i}".encode() for i in range(4)]
WRITTEN_FROM = [1, 2, 3, 4]  # the blocks the old tree stored
LOADED_INTO = [7, 6, 5, 0]  # where today's tree loads them (other blocks: the bytes move)


def written_caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(44)
    return {name: torch.randint(-100, 100, (2, NUM_BLOCKS, 16, 1, 8), generator=gen)
            .to(torch.bfloat16) for name in LAYERS}


def open_previous(mode: str, tmp_path: Path, *, with_record: bool):
    root = tmp_path / mode
    shutil.copytree(FIXTURE / mode, root)
    extra = {"cpu_bytes_to_use": "1MiB", "storage_tier": "filesystem",
             "storage_options": {"root_dir": str(root), "bytes_to_use": "16MiB"}}
    if mode == "encrypted":
        secret = tmp_path / "secret"
        shutil.copy(FIXTURE / "secret", secret)
        secret.chmod(0o600)  # (git keeps no file modes but the executable bit)
        extra.update(secret_file=str(secret), encrypt=True)
    caches = {name: torch.zeros(2, NUM_BLOCKS, 16, 1, 8, dtype=torch.bfloat16)
              for name in LAYERS}
    canonical = canonicalize(caches, [KVCacheGroup(LAYERS, SPEC)], NUM_BLOCKS)
    config, fingerprint = parse_config(extra), layout_fingerprint(canonical, "tp0/1")
    if with_record:
        [layout_dir] = [d for d in root.iterdir() if d.is_dir()]
        codec = make_codec(config.secret_file, config.encrypt)
        (layout_dir / GENERATION_NAME).write_bytes(
            generation_record(FIRST_GENERATION, codec, fingerprint))
    return caches, TieredStore.from_config(canonical, config, fingerprint)


def test_an_upgraded_store_without_a_generation_record_starts_cold(tmp_path):
    _, store = open_previous("plain", tmp_path, with_record=False)
    try:
        assert store.generation != FIRST_GENERATION
        for _ in range(50):
            store.poll()
        assert store.lookup([(h, 0) for h in HASHES]) == [Location.ABSENT] * len(HASHES)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["plain", "encrypted"])
def test_a_directory_written_by_the_previous_release_is_served(mode, tmp_path):
    caches, store = open_previous(mode, tmp_path, with_record=True)
    try:
        keys = [(h, 0) for h in HASHES]
        deadline = time.monotonic() + 30
        while store.lookup(keys) != [Location.STORAGE] * len(keys):  # (its inventory)
            assert time.monotonic() < deadline, store.lookup(keys)
            store.poll()
            time.sleep(0.01)
        (result,) = store.wait([store.submit_load({0: (HASHES, LOADED_INTO)})])
        assert result.success and result.from_storage == len(HASHES), result
    finally:
        store.close()
    written = written_caches()
    for name in LAYERS:
        assert torch.equal(caches[name][:, LOADED_INTO], written[name][:, WRITTEN_FROM]), name
        assert not caches[name][:, [1, 2, 3, 4]].any()  # nothing else was written
