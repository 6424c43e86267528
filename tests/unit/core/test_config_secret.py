"""`secret_file` and `encrypt` in kv_connector_extra_config: checked at start-up, never logged."""

from __future__ import annotations

import os
import sys

import pytest

from kv_offload.config import parse_config
from kv_offload.errors import ConfigError
from kv_offload.store.startup_checks import check_before_engine_start, check_config

SECRET = b"0123456789abcdef0123456789abcdef"


def secret_file(tmp_path, content: bytes = SECRET, mode: int = 0o600) -> str:
    path = tmp_path / "kv-secret"
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


def parse(**extra):
    return parse_config({"cpu_bytes_to_use": "1MiB", **extra})


def test_a_private_secret_file_is_accepted_and_only_its_path_is_kept(tmp_path):
    path = secret_file(tmp_path, SECRET + b"\n")
    config = parse(secret_file=path)
    assert config.secret_file == path and config.encrypt is False
    assert SECRET.decode() not in repr(config)
    assert parse(secret_file=path, encrypt=True).encrypt is True


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_secret_file_group_or_other_can_reach_is_refused_with_the_chmod_fix(tmp_path, mode):
    path = secret_file(tmp_path, mode=mode)
    with pytest.raises(ConfigError, match=rf"secret_file.*{oct(mode)[2:]}.*chmod 600 {path}"):
        parse(secret_file=path)


def test_a_missing_secret_file_is_refused_with_how_to_create_one(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"secret_file .*does not exist.*kv-offload secret new"):
        parse(secret_file=missing)


def test_an_empty_or_short_secret_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"secret_file .* is empty"):
        parse(secret_file=secret_file(tmp_path, b" \n"))
    with pytest.raises(ConfigError, match=r"secret_file .* holds 5 bytes; expected at least 16"):
        parse(secret_file=secret_file(tmp_path, b"short\n"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_file_is_refused(tmp_path):
    path = secret_file(tmp_path, mode=0o000)
    with pytest.raises(ConfigError, match=r"secret_file .*cannot be opened"):
        parse(secret_file=path)


def test_a_directory_is_not_a_secret_file(tmp_path):
    os.chmod(tmp_path, 0o700)
    with pytest.raises(ConfigError, match=r"secret_file .*not a regular file"):
        parse(secret_file=str(tmp_path))


def test_no_error_message_contains_the_secret(tmp_path):
    path = secret_file(tmp_path, mode=0o644)
    with pytest.raises(ConfigError) as info:
        parse(secret_file=path)
    assert SECRET.decode() not in str(info.value)


def test_encrypt_needs_a_secret_file_and_a_bool(tmp_path):
    with pytest.raises(ConfigError, match="encrypt: true needs secret_file"):
        parse(encrypt=True)
    with pytest.raises(ConfigError, match="encrypt must be true or false, got 'yes'"):
        parse(secret_file=secret_file(tmp_path), encrypt="yes")
    assert parse(encrypt=False).encrypt is False
    with pytest.raises(ConfigError, match="secret_file must be a non-empty path string"):
        parse(secret_file=3)


def test_a_secret_without_the_cryptography_package_names_the_extra(tmp_path, monkeypatch):
    # (None in sys.modules makes that import fail, as on a machine without the package)
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.kdf.hkdf", None)
    config = parse(secret_file=secret_file(tmp_path))  # (the cipher is the tiers' concern)
    with pytest.raises(ConfigError, match=r"pip install 'kv-offload\[secure\]'"):
        check_config(config)  # at start-up, in every process, before the model loads
    with pytest.raises(ConfigError, match=r"pip install 'kv-offload\[secure\]'"):
        check_before_engine_start({"cpu_bytes_to_use": "1MiB", "secret_file": config.secret_file})
