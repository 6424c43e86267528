"""kv_connector_extra_config parsing: accepted values and errors that name the key."""

from __future__ import annotations

import os

import pytest

from kv_offload.config import OffloadConfig, parse_config, parse_size
from kv_offload.errors import ConfigError


def test_minimal_config_uses_defaults():
    config = parse_config({"cpu_bytes_to_use": 1 << 30})
    assert config == OffloadConfig(cpu_bytes_to_use=1 << 30)
    assert config.eviction_policy == "slru" and config.fs_root_dir is None


def test_full_config(tmp_path):
    config = parse_config({
        "cpu_bytes_to_use": "16GiB", "fs_root_dir": str(tmp_path), "fs_bytes_to_use": "1.5 TB",
        "block_size": 256, "eviction_policy": "arc", "fs_fsync": True, "layer_wise": True,
        "copy_timeout_s": 5,
    })
    assert config.layer_wise and not OffloadConfig(cpu_bytes_to_use=1).layer_wise
    assert config.copy_timeout_s == 5.0 and OffloadConfig(cpu_bytes_to_use=1).copy_timeout_s == 30
    assert config.cpu_bytes_to_use == 16 * 2**30
    assert config.fs_bytes_to_use == 1_500_000_000_000
    assert config.fs_root_dir == str(tmp_path)
    assert (config.block_size, config.eviction_policy, config.fs_fsync) == (256, "arc", True)


def test_relative_and_home_paths_are_made_absolute():
    config = parse_config({"cpu_bytes_to_use": 1, "fs_root_dir": "~/kv", "fs_bytes_to_use": 1})
    assert config.fs_root_dir == os.path.expanduser("~/kv")


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("4096", 4096), ("2KiB", 2048), ("3 MB", 3_000_000), ("1gib", 2**30),
])
def test_sizes(value, expected):
    assert parse_size("k", value) == expected


@pytest.mark.parametrize("extra, message", [
    ({}, "cpu_bytes_to_use is required"),
    ({"cpu_bytes_to_use": 1, "cpu_byte_to_use": 2}, r"unknown key\(s\) \['cpu_byte_to_use'\]"),
    ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use must be a byte size"),
    ({"cpu_bytes_to_use": "5 parsecs"}, "cpu_bytes_to_use must be a byte size"),
    ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use must be positive"),
    ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use must be a byte size"),
    ({"cpu_bytes_to_use": 1, "fs_root_dir": "/x"}, "fs_bytes_to_use is required"),
    ({"cpu_bytes_to_use": 1, "fs_bytes_to_use": 5}, "fs_root_dir is not"),
    ({"cpu_bytes_to_use": 1, "fs_root_dir": 3, "fs_bytes_to_use": 1}, "fs_root_dir must be"),
    ({"cpu_bytes_to_use": 1, "block_size": 0}, "block_size must be a positive int"),
    ({"cpu_bytes_to_use": 1, "block_size": "16"}, "block_size must be a positive int"),
    ({"cpu_bytes_to_use": 1, "fs_fsync": "yes"}, "fs_fsync must be true or false"),
    ({"cpu_bytes_to_use": 1, "layer_wise": 1}, "layer_wise must be true or false"),
    ({"cpu_bytes_to_use": 1, "copy_timeout_s": 0}, "copy_timeout_s must be a number of seconds"),
    ({"cpu_bytes_to_use": 1, "copy_timeout_s": "30"}, "copy_timeout_s must be a number"),
    ({"cpu_bytes_to_use": 1, "copy_timeout_s": 601}, "above 0 and at most 600, got 601"),
])
def test_errors_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(extra)


def test_unknown_key_error_lists_accepted_keys():
    with pytest.raises(ConfigError) as info:
        parse_config({"cpu_bytes_to_use": 1, "colour": "red"})
    for key in ("cpu_bytes_to_use", "fs_root_dir", "fs_bytes_to_use", "block_size",
                "eviction_policy"):
        assert key in str(info.value)


def test_custom_policy_path_is_accepted():
    assert parse_config({"cpu_bytes_to_use": 1, "eviction_policy": "my.mod:Policy"}) \
        .eviction_policy == "my.mod:Policy"


def test_block_size_is_the_engine_block_size_or_refused_naming_the_fix():
    config = parse_config({"cpu_bytes_to_use": 1, "block_size": 96})
    with pytest.raises(ConfigError, match="leave block_size unset or set it to 32"):
        config.check_engine_block_size(32)
    assert parse_config({"cpu_bytes_to_use": 1, "block_size": 32}) \
        .check_engine_block_size(32) == 32
    assert parse_config({"cpu_bytes_to_use": 1}).check_engine_block_size(16) == 16
