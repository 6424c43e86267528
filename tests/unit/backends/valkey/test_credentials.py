"""Valkey credentials: a password only from a private file (never in the URL that vLLM logs),
an ACL username, a wrong password a clear start-up error, and the password nowhere in logs,
errors or reprs. Against a real redis-server with requirepass and an ACL user."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers.servers import unique_name
from helpers.tier_helpers import random_bytes, read, write

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from kv_offload.backends.valkey import ValkeyTier  # noqa: E402 (after the skip)
from kv_offload.backends.valkey.local_server import server_binary  # noqa: E402
from kv_offload.errors import ConfigError  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
ADMIN_PASSWORD = "admin-Pa55-word-xyzzy"
USER_PASSWORD = "alice-Pa55-word-plugh"


@pytest.fixture(scope="module")
def protected_server():
    if server_binary() is None:
        pytest.skip("no Valkey/Redis server binary on PATH (apt-get install -y redis-server)")
    from kv_offload.backends.valkey.local_server import LocalServer

    server = LocalServer(extra_args=("--requirepass", ADMIN_PASSWORD))
    admin = redis.Redis.from_url(server.url, password=ADMIN_PASSWORD)
    admin.execute_command("ACL", "SETUSER", "alice", "on", f">{USER_PASSWORD}", "~kv*",
                          "+@all")
    yield server
    server.stop()


def password_file(tmp_path, password: str, mode: int = 0o600) -> str:
    path = tmp_path / unique_name("password")
    path.write_text(password + "\n")
    path.chmod(mode)
    return str(path)


def make_tier(url: str, **options) -> ValkeyTier:
    return ValkeyTier.from_options({"url": url, "key_prefix": unique_name("kv") + ":",
                                    "refresh_interval_s": 0, **options}, FINGERPRINT)


def roundtrip(tier: ValkeyTier) -> None:
    data = random_bytes(5000, 1)
    assert write(tier, [b"k"], [data]).ok
    out = torch.empty(5000, dtype=torch.uint8)
    assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)


def test_the_requirepass_password_comes_from_a_file_and_is_never_logged_or_shown(
        protected_server, tmp_path, caplog):
    with caplog.at_level(logging.DEBUG):
        tier = make_tier(protected_server.url,
                         password_file=password_file(tmp_path, ADMIN_PASSWORD))
        roundtrip(tier)
        tier.refresh()
        shown = [repr(tier.config), str(tier.config), repr(tier), repr(tier.stats()),
                 repr(tier._redis), repr(tier._redis.connection_pool),
                 tier.config.display_url]
        tier.close()
    text = "\n".join(shown + [r.getMessage() for r in caplog.records])
    assert ADMIN_PASSWORD not in text


def test_an_acl_user_logs_in_with_username_and_password_file(protected_server, tmp_path):
    tier = make_tier(protected_server.url, username="alice",
                     password_file=password_file(tmp_path, USER_PASSWORD))
    roundtrip(tier)
    tier.close()


@pytest.mark.parametrize("given", ["wrong password", "no password", "wrong user"])
def test_refused_credentials_are_a_clear_start_up_error_without_the_password(
        protected_server, tmp_path, caplog, given):
    options = {
        "wrong password": {"password_file": password_file(tmp_path, "not-" + USER_PASSWORD)},
        "no password": {},
        "wrong user": {"username": "mallory",
                       "password_file": password_file(tmp_path, USER_PASSWORD)},
    }[given]
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as error:
        make_tier(protected_server.url, **options)
    message = str(error.value)
    assert "refused the credentials" in message and protected_server.url.split("//")[1] in message
    text = message + "\n".join(r.getMessage() for r in caplog.records)
    assert USER_PASSWORD not in text and ADMIN_PASSWORD not in text


def test_a_password_in_the_url_is_refused_and_not_repeated(protected_server):
    url = protected_server.url.replace("redis://", f"redis://alice:{USER_PASSWORD}@")
    with pytest.raises(ConfigError, match="password_file") as error:
        ValkeyTier.check_options({"url": url})
    assert USER_PASSWORD not in str(error.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_password_file_others_can_read_is_refused_at_start(tmp_path, mode):
    path = password_file(tmp_path, USER_PASSWORD, mode)
    with pytest.raises(ConfigError, match="chmod 600") as error:
        ValkeyTier.check_options({"url": "redis://127.0.0.1:6379/0", "password_file": path})
    assert USER_PASSWORD not in str(error.value)


def test_a_missing_or_empty_password_file_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="absent. does not exist; expected a file holding"):
        ValkeyTier.check_options({"url": "redis://127.0.0.1:6379/0",
                                  "password_file": str(tmp_path / "absent")})
    with pytest.raises(ConfigError, match="is empty"):
        ValkeyTier.check_options({"url": "redis://127.0.0.1:6379/0",
                                  "password_file": password_file(tmp_path, "")})
