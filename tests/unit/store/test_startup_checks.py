"""Start-up checks: what can be known before the model loads is a ConfigError naming the
key and the fix, never an OOM kill, a silently disabled tier or a first-request error."""

from __future__ import annotations

import pytest
import torch

from kv_offload.config import parse_config
from kv_offload.errors import ConfigError, EvictionPolicyError
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.store.startup_checks import (
    FILE_HEADER_ALLOWANCE,
    block_bytes,
    check_before_engine_start,
    check_config,
    check_startup,
)

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
GROUPS = [KVCacheGroup([f"layers.{i}" for i in range(4)], SPEC)]
BLOCK = 4 * SPEC.page_size_bytes
PLENTY = 1 << 40


def config(**extra):
    return parse_config({"cpu_bytes_to_use": "64MiB", **extra})


def disk(root, budget, spelling: str):
    """The disk tier in the documented spelling (storage_options) or the old one (fs_*)."""
    if spelling == "old":
        with pytest.warns(FutureWarning, match="old spelling of the disk tier"):
            return config(fs_root_dir=str(root), fs_bytes_to_use=budget)
    return config(storage_tier="filesystem",
                  storage_options={"root_dir": str(root), "bytes_to_use": budget})


SPELLINGS = pytest.mark.parametrize("spelling, root_key, budget_key", [
    ("options", "storage_options.root_dir", "storage_options.bytes_to_use"),
    ("old", "fs_root_dir", "fs_bytes_to_use")])


@SPELLINGS
def test_a_sane_config_passes(tmp_path, spelling, root_key, budget_key):
    check_startup(disk(tmp_path / "kv", "1GiB", spelling), GROUPS, available=PLENTY)
    assert (tmp_path / "kv").is_dir()  # created up front, as the tier will need it


@pytest.mark.parametrize("policy", ["fifo", 3, ""])
def test_an_eviction_policy_that_is_not_a_name_or_a_path_is_refused_at_every_start(policy):
    """config.py sits below the store: the policy's name is judged here, as early (every
    process, before the model loads), with the same error."""
    message = r"eviction_policy must be one of \[.slru., .lru., .arc.\] or .package"
    with pytest.raises(ConfigError, match=message):
        check_config(config(eviction_policy=policy))
    with pytest.raises(ConfigError, match=message):
        check_startup(config(eviction_policy=policy), GROUPS, available=PLENTY)
    with pytest.raises(ConfigError, match=message):
        check_before_engine_start({"cpu_bytes_to_use": "64MiB", "eviction_policy": policy})


def test_a_bad_storage_option_is_refused_at_every_start():
    extra = {"cpu_bytes_to_use": "64MiB", "storage_tier": "kv_offload.backends.example:DictTier",
             "storage_options": {"max_byte": 1}}
    with pytest.raises(ConfigError, match="max_byte"):
        check_startup(parse_config(extra), GROUPS, available=PLENTY)
    with pytest.raises(ConfigError, match="max_byte"):
        check_before_engine_start(extra)


def test_an_eviction_policy_that_does_not_import_is_refused():
    with pytest.raises(EvictionPolicyError, match="no_such_module"):
        check_startup(config(eviction_policy="no_such_module:Policy"), GROUPS,
                      available=PLENTY)


def test_host_tiers_larger_than_the_memory_available_are_refused():
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=.* x 2 rank\(s\).*available"):
        check_startup(config(), GROUPS, local_ranks=2, available=100 << 20)
    check_startup(config(), GROUPS, local_ranks=1, available=100 << 20)


def test_a_host_tier_smaller_than_one_block_is_refused():
    with pytest.raises(ConfigError, match=f"holds no block.*{BLOCK}"):
        check_startup(parse_config({"cpu_bytes_to_use": BLOCK - 1}), GROUPS, available=PLENTY)
    assert block_bytes(GROUPS) == BLOCK


@SPELLINGS
def test_a_disk_budget_smaller_than_one_block_file_is_refused(tmp_path, spelling, root_key,
                                                              budget_key):
    too_small = BLOCK + FILE_HEADER_ALLOWANCE - 1
    with pytest.raises(ConfigError, match=f"{budget_key}=.*cannot hold one block file"):
        check_startup(disk(tmp_path, too_small, spelling), GROUPS, available=PLENTY)


@SPELLINGS
def test_a_root_dir_that_is_a_file_or_cannot_be_created_is_refused(tmp_path, spelling,
                                                                   root_key, budget_key):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=f"{root_key}=.*is not a directory"):
        check_startup(disk(afile, "1GiB", spelling), GROUPS, available=PLENTY)
    with pytest.raises(ConfigError, match=f"{root_key}=.*not a writable directory"):
        check_startup(disk(afile / "below", "1GiB", spelling), GROUPS, available=PLENTY)


def test_the_host_pool_is_exactly_whole_slots_within_the_budget():
    from kv_offload.canonical import canonicalize
    from kv_offload.kernels.geometry import HostSlotLayout
    from kv_offload.store.host.pool import allocate_pool
    from kv_offload.testing.example_models import build_example

    model = build_example("llama-8b", num_blocks=2)
    canonical = canonicalize(model.kv_caches, model.groups, model.num_blocks)
    layout = HostSlotLayout.from_canonical(canonical)
    budget = 20 * layout.slot_bytes + layout.slot_bytes // 2
    pool = allocate_pool(layout, budget, pin=False)
    assert pool.shape == (20, layout.slot_bytes)
    assert pool.numel() <= budget


def test_sizes_in_errors_read_in_human_units_beside_the_exact_count():
    """A size error printed raw bytes (`536870912000`) a reader had to count."""
    config = parse_config({"cpu_bytes_to_use": "500GiB"})
    with pytest.raises(ConfigError) as err:
        check_startup(config, (), local_ranks=2, available=64 << 30)
    message = str(err.value)
    assert "cpu_bytes_to_use=500.0 GiB (536870912000 bytes) x 2 rank(s) = 1000.0 GiB" in message
    assert "only 64.0 GiB (68719476736 bytes) are available" in message
