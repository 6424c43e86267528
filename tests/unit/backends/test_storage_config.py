"""`storage_tier` + `storage_options`: tiers chosen by config, checked at start-up
(`check_config`, run by every start-up check; nothing connects), opened by
`make_storage_tier` / `TieredStore.from_config`."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from kv_offload.backends import BUILTIN_TIERS, make_storage_tier, tier_class
from kv_offload.backends.base import StorageTier
from kv_offload.backends.example import DictTier
from kv_offload.backends.filesystem import FilesystemTier
from kv_offload.config import parse_config
from kv_offload.errors import ConfigError
from kv_offload.store.startup_checks import check_config
from kv_offload.store.tiered import Location, TieredStore, layout_fingerprint

from helpers.servers import new_secret_file, shared_tier_options
from unit.store.test_tiering import block_bytes, h, hybrid, wait_for_storage

EXAMPLE = "kv_offload.backends.example:DictTier"
# Nothing listens here: parsing must not try (it would take the connect timeout or fail).
NOWHERE = "redis://127.0.0.1:9/0"


def parse(tier, options=None, **extra):
    """The config, with the start-up check of the tier's options (as every process runs it)."""
    values = {"cpu_bytes_to_use": "1MiB", "storage_tier": tier, **extra}
    if options is not None:
        values["storage_options"] = options
    config = parse_config(values)
    check_config(config)
    return config


def test_builtin_names_resolve_lazily_to_tier_classes():
    assert sorted(BUILTIN_TIERS) == ["filesystem", "s3", "valkey"]
    assert tier_class("filesystem") is FilesystemTier
    assert tier_class(EXAMPLE) is DictTier
    for name in BUILTIN_TIERS:
        assert issubclass(tier_class(name), StorageTier)


def test_valkey_and_s3_options_are_checked_without_connecting():
    pytest.importorskip("redis")
    pytest.importorskip("boto3")
    start = time.monotonic()
    config = parse("valkey", {"url": NOWHERE, "key_prefix": "team-a:", "timeout_s": 0.5},
                   trusted_store=True)
    assert config.storage_tier == "valkey" and config.storage_options["url"] == NOWHERE
    config = parse("s3", {"bucket": "kv", "bytes_to_use": "10GiB",
                          "endpoint_url": "http://127.0.0.1:9"}, trusted_store=True)
    assert config.storage_options["bytes_to_use"] == "10GiB"  # parsed again by the tier
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("tier, options, message", [
    ("valkey", {"url": NOWHERE, "timeout": 1}, r"unknown storage_options \['timeout'\] for "
     r"storage_tier 'valkey'; accepted: url \(str, required\), key_prefix"),
    ("valkey", {}, r"storage_options.url is required for storage_tier 'valkey'"),
    ("valkey", {"url": "http://x:1"}, r"storage_options.url must start with one of"),
    ("valkey", {"url": "redis://host:port/0"}, r"storage_options.url has a bad port"),
    ("valkey", {"url": "redis://h:1/zero"}, r"the database must be a number"),
    ("valkey", {"url": NOWHERE, "timeout_s": "fast"}, r"storage_options.timeout_s must be a "
     r"number of seconds"),
    ("valkey", {"url": NOWHERE, "timeout_s": 0}, r"storage_options.timeout_s must be > 0"),
    ("valkey", {"url": NOWHERE, "connections": 0}, r"storage_options.connections must be an "
     r"int >= 1"),
    ("valkey", {"url": NOWHERE, "batch_bytes": "big"}, r"storage_options.batch_bytes must be "
     r"a byte size"),
    ("valkey", {"url": NOWHERE, "retry_interval_s": 0}, r"storage_options.retry_interval_s "
     r"must be > 0"),
    ("s3", {"bucket": "b", "bytes_to_use": 1, "connect_timeout_s": 0},
     r"storage_options.connect_timeout_s must be > 0"),
    ("s3", {"bytes_to_use": "1GiB"}, r"storage_options.bucket is required"),
    ("s3", {"bucket": "b"}, r"storage_options.bytes_to_use is required"),
    ("s3", {"bucket": "b", "bytes_to_use": 1, "endpoint_url": "minio:9000"},
     r"endpoint_url must start with http:// or https://"),
    ("s3", {"bucket": "b", "bytes_to_use": 1, "conditional_put": "yes"},
     r"storage_options.conditional_put must be true or false"),
    ("s3", {"bucket": "b", "bytes_to_use": 1, "aws_secret_access_key": "x"},
     r"unknown storage_options \['aws_secret_access_key'\]"),
    ("filesystem", {"root_dir": "/tmp/x"}, r"storage_options.bytes_to_use is required"),
    ("filesystem", {"root_dir": "/tmp/x", "bytes_to_use": 1, "fsync": 1},
     r"storage_options.fsync must be true or false"),
    ("memcached", {}, r"unknown storage_tier 'memcached'; expected one of \['filesystem', "
     r"'s3', 'valkey'\] or 'package.module:ClassName'"),
    ("no_such_module_xyz:Tier", {}, r"cannot import no_such_module_xyz"),
    ("kv_offload.backends.example:NoSuchTier", {}, r"has no StorageTier subclass named "
     r"'NoSuchTier'"),
    ("kv_offload.config:OffloadConfig", {}, r"has no StorageTier subclass"),
    (EXAMPLE, {"max_byte": 10}, r"unknown storage_options \['max_byte'\] for DictTier; "
     r"accepted: \['max_bytes'\]"),
    (EXAMPLE, [1, 2], r"storage_options must be a dict"),
    ("", None, r"storage_tier must be a tier name"),
])
def test_bad_choices_and_options_raise_a_config_error_naming_them(tier, options, message):
    if tier in ("valkey", "s3"):
        pytest.importorskip("redis" if tier == "valkey" else "boto3")
    with pytest.raises(ConfigError, match=message):
        parse(tier, options)


def test_a_missing_client_library_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    for name in [n for n in sys.modules if n.startswith("kv_offload.backends.valkey")]:
        monkeypatch.delitem(sys.modules, name)  # (each module that imports redis-py)
    with pytest.raises(ConfigError, match=r"pip install 'kv-offload\[valkey\]'"):
        parse("valkey", {"url": NOWHERE})


def test_the_two_ways_to_choose_a_tier_cannot_be_mixed(tmp_path):
    with pytest.raises(ConfigError, match="fs_root_dir and storage_tier='valkey' both"):
        parse("valkey", {"url": NOWHERE}, fs_root_dir=str(tmp_path), fs_bytes_to_use=1)
    with pytest.raises(ConfigError, match="storage_options is set but storage_tier is not"):
        parse_config({"cpu_bytes_to_use": 1, "storage_options": {"url": NOWHERE}})


def test_a_third_party_tier_is_built_from_its_constructor_options():
    tier = make_storage_tier(parse(EXAMPLE, {"max_bytes": 12345}), "fp")
    assert isinstance(tier.inner, DictTier) and tier.inner.max_bytes == 12345
    assert isinstance(make_storage_tier(parse(EXAMPLE), "fp").inner, DictTier)


class SharedDictTier(DictTier):
    """A plug-in whose store outlives one tier object (as a plug-in on a shared server's)."""

    store: dict = {}

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        super().__init__(max_bytes)
        self._data = SharedDictTier.store


def test_two_models_sharing_a_plug_in_tier_never_see_each_others_blocks(monkeypatch):
    from helpers.tier_helpers import random_bytes, read, write

    module = types.ModuleType("shared_tier_mod")
    module.SharedDictTier = SharedDictTier
    monkeypatch.setitem(sys.modules, "shared_tier_mod", module)
    config = parse("shared_tier_mod:SharedDictTier")
    model_a = make_storage_tier(config, "llama|LBHNC|page=4096")
    model_b = make_storage_tier(config, "gemma|LBHNC|page=4096")
    data = random_bytes(4096, 1)
    assert write(model_a, [b"block-hash"], [data]).ok  # the same prompt's block hash
    assert model_b.lookup([b"block-hash"]) == [False]
    out = torch.zeros(4096, dtype=torch.uint8)
    assert read(model_b, [b"block-hash"], [out]).succeeded == (False,)
    assert not out.any()
    assert read(model_a, [b"block-hash"], [out]).ok and torch.equal(out, data)
    assert model_a.keys() is None  # (DictTier cannot list)
    assert model_a.take_changes(10).added == ()


def test_a_third_party_tier_can_check_its_own_options(monkeypatch):
    class Picky(DictTier):
        @classmethod
        def check_options(cls, options):
            if options.get("max_bytes", 1) % 2:
                raise ConfigError("storage_options.max_bytes must be even")

    module = types.ModuleType("picky_tier_mod")
    module.Picky = Picky
    monkeypatch.setitem(sys.modules, "picky_tier_mod", module)
    assert parse("picky_tier_mod:Picky", {"max_bytes": 2}).storage_tier == "picky_tier_mod:Picky"
    with pytest.raises(ConfigError, match="must be even"):
        parse("picky_tier_mod:Picky", {"max_bytes": 3})


def test_the_filesystem_tier_by_either_spelling(tmp_path):
    """storage_options is the one documented spelling; the old fs_* keys still open the
    same tier until 0.2, with a FutureWarning (shown by default) naming the new spelling."""
    with pytest.warns(FutureWarning, match='fs_root_dir, fs_bytes_to_use: the old spelling.*'
                                           '"storage_tier": "filesystem"'):
        old_config = parse_config({"cpu_bytes_to_use": 1, "fs_root_dir": str(tmp_path),
                                   "fs_bytes_to_use": "1MiB"})
    old = make_storage_tier(old_config, "fp")
    new = make_storage_tier(parse("filesystem", {"root_dir": str(tmp_path / "b"),
                                                 "bytes_to_use": "2MiB", "io_threads": 2,
                                                 "rescan_interval_s": 0}), "fp")
    assert isinstance(old, FilesystemTier) and isinstance(new, FilesystemTier)
    assert (old.config.root_dir, old.config.bytes_to_use) == (str(tmp_path), 1 << 20)
    assert (new.config.bytes_to_use, new.config.io_threads) == (2 << 20, 2)
    assert new.config.layout_fingerprint == "fp"
    old.close()
    new.close()
    assert make_storage_tier(parse_config({"cpu_bytes_to_use": 1}), "fp") is None


@pytest.mark.parametrize("backend", ["valkey", "s3"])
def test_tiered_store_serves_a_new_process_from_the_shared_tier(request, backend, tmp_path):
    """Two TieredStores (two engines sharing a secret) on one server: the second has an
    empty host tier and loads what the first stored, bit for bit, through the shared tier."""
    buffer, canonical = hybrid()
    options = shared_tier_options(backend, request, "tiered")
    config = parse(backend, options, secret_file=new_secret_file(tmp_path))
    fingerprint = layout_fingerprint(canonical, "test-model")
    first = TieredStore.from_config(canonical, config, fingerprint)
    expected = {(g, b): block_bytes(canonical, g, b) for g in (0, 1) for b in (1, 2)}
    [stored] = first.wait([first.submit_store({0: ([h(1), h(2)], [1, 2]), 1: ([h(2)], [2])})])
    assert stored.success
    first.flush()
    first.close()
    second = TieredStore.from_config(canonical, config, fingerprint)
    wait_for_storage(second, [(h(1), 0), (h(2), 1)])  # the tier's change feed, absorbed
    assert second.lookup([(h(3), 0)]) == [Location.ABSENT]
    buffer.zero_()
    [loaded] = second.wait([second.submit_load({0: ([h(2), h(1)], [5, 6]), 1: ([h(2)], [7])})])
    assert loaded.success and loaded.from_storage == 3
    assert torch.equal(block_bytes(canonical, 0, 5), expected[0, 2])
    assert torch.equal(block_bytes(canonical, 0, 6), expected[0, 1])
    assert torch.equal(block_bytes(canonical, 1, 7), expected[1, 2])
    second.close()


def test_asking_tier_stats_whether_they_counted_a_name_answers_at_once():
    from kv_offload.backends.base import TierStats

    stats = TierStats(counts={"write_failed": 2})
    assert "write_failed" in stats and "read_failed" not in stats  # (it looped for ever)
    assert stats["read_failed"] == 0 and stats["write_failed"] == 2
