"""Shared stores are secure by default: a storage tier others can write to (valkey, s3, a
plug-in whose class sets `shared = True`) starts only with `secret_file` or the explicit
opt-out `trusted_store: true`; otherwise every start-up check refuses it with a ConfigError
that names both fixes and the command that makes a secret. Private stores (the filesystem
tier, the example plug-in) are unchanged, and `trusted_store` where it means nothing is
refused too."""

from __future__ import annotations

import pytest

from kv_offload.backends.example import DictTier
from kv_offload.config import parse_config
from kv_offload.errors import ConfigError
from kv_offload.store.startup_checks import (
    check_before_engine_start,
    check_config,
    check_startup,
)
from kv_offload.tools.secret_cmd import write_new_secret

PLENTY = 1 << 40
SHARED_TIERS = {
    "valkey": {"url": "redis://127.0.0.1:1/0"},  # (checked, never connected to)
    "s3": {"bucket": "kv", "bytes_to_use": "1GiB"},
    "unit.store.test_shared_store_trust:SharedDictTier": {},
}
REFUSAL = (r"storage_tier '.*' is a shared store.*secret_file.*kv-offload secret new PATH"
           r".*\"trusted_store\": true")


class SharedDictTier(DictTier):
    """A plug-in that declares that others can write where it stores."""

    shared = True


def extra(tier: str, **keys) -> dict:
    return {"cpu_bytes_to_use": "64MiB", "storage_tier": tier,
            "storage_options": SHARED_TIERS.get(tier, {}), **keys}


@pytest.fixture
def secret(tmp_path) -> str:
    path = str(tmp_path / "secret")
    write_new_secret(path)
    return path


@pytest.mark.parametrize("tier", sorted(SHARED_TIERS))
def test_a_shared_tier_without_secret_file_or_trusted_store_is_refused_at_every_start(tier):
    with pytest.raises(ConfigError, match=REFUSAL):
        check_config(parse_config(extra(tier)))
    with pytest.raises(ConfigError, match=REFUSAL):
        check_startup(parse_config(extra(tier)), (), available=PLENTY)
    with pytest.raises(ConfigError, match=REFUSAL):
        check_before_engine_start(extra(tier))


@pytest.mark.parametrize("tier", sorted(SHARED_TIERS))
def test_a_shared_tier_starts_with_secret_file(tier, secret):
    pytest.importorskip("cryptography")
    check_before_engine_start(extra(tier, secret_file=secret))


@pytest.mark.parametrize("tier", sorted(SHARED_TIERS))
def test_a_shared_tier_starts_with_trusted_store(tier):
    config = check_before_engine_start(extra(tier, trusted_store=True))
    assert config.trusted_store is True and config.secret_file is None


def test_the_filesystem_tier_and_a_private_plug_in_still_start_without_a_secret(tmp_path):
    check_before_engine_start(extra("filesystem", storage_options={
        "root_dir": str(tmp_path / "kv"), "bytes_to_use": "1GiB"}))
    check_before_engine_start(extra("kv_offload.backends.example:DictTier"))


def test_the_built_in_shared_tiers_declare_it_and_the_filesystem_tier_does_not():
    from kv_offload.backends import tier_class

    assert tier_class("valkey").shared and tier_class("s3").shared
    assert not tier_class("filesystem").shared and not DictTier.shared


def test_trusted_store_with_secret_file_is_refused_as_a_contradiction(secret):
    with pytest.raises(ConfigError, match="trusted_store: true and secret_file both set.*"
                                          "remove trusted_store"):
        parse_config(extra("valkey", secret_file=secret, trusted_store=True))


@pytest.mark.parametrize("tier", [None, "filesystem", "kv_offload.backends.example:DictTier"])
def test_trusted_store_on_a_tier_that_is_not_shared_is_refused(tier, tmp_path):
    keys = {"cpu_bytes_to_use": "64MiB", "trusted_store": True}
    if tier is not None:
        keys.update(extra(tier))
    if tier == "filesystem":
        keys["storage_options"] = {"root_dir": str(tmp_path / "kv"), "bytes_to_use": "1GiB"}
    with pytest.raises(ConfigError, match="trusted_store: true, but .* is not a shared store"
                                          ".*remove trusted_store"):
        check_before_engine_start(keys)


def test_trusted_store_must_be_a_boolean():
    with pytest.raises(ConfigError, match="trusted_store must be true or false, got 'yes'"):
        parse_config(extra("valkey", trusted_store="yes"))
