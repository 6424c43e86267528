"""The Valkey tier over TLS (rediss://) against a real redis-server with TLS only
(--port 0 --tls-port, --tls-auth-clients yes) and certificates made by openssl: a CA file
and a client certificate connect, with an ACL user too; a wrong CA, a client certificate
from another CA, no client certificate, or a wrong password is a clear start-up ConfigError
naming the server; no key or password ever reaches a log line or an error."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers.servers import unique_name
from helpers.tier_helpers import random_bytes, read, write
from helpers.tls_certs import make_authority, openssl_binary

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from kv_offload.backends.valkey import ValkeyTier  # noqa: E402 (after the skip)
from kv_offload.backends.valkey.local_server import (  # noqa: E402
    LocalServer,
    ServerTls,
    server_binary,
)
from kv_offload.errors import ConfigError  # noqa: E402

FINGERPRINT = "llama|LBHNC|page=4096|tp1|rank0"
USER_PASSWORD = "carol-Pa55-word-tls"


pytestmark = pytest.mark.skipif(
    server_binary() is None or openssl_binary() is None,
    reason="needs redis-server and openssl on PATH (apt-get install -y redis-server openssl)")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return make_authority(root, "good"), make_authority(root, "other")


@pytest.fixture(scope="module")
def tls_server(pki):
    good, _ = pki
    tls = ServerTls(good.server_cert_file, good.server_key_file, good.ca_file,
                    good.client_cert_file, good.client_key_file)
    try:
        server = LocalServer(tls=tls)
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"this redis-server was built without TLS: {e}")
        raise
    with redis.Redis.from_url(server.url, ssl_ca_certs=good.ca_file,
                              ssl_certfile=good.client_cert_file,
                              ssl_keyfile=good.client_key_file) as admin:
        admin.execute_command("ACL", "SETUSER", "carol", "on", f">{USER_PASSWORD}", "~kv*",
                              "+@all")
    yield server
    server.stop()


def password_file(tmp_path) -> str:
    path = tmp_path / unique_name("password")
    path.write_text(USER_PASSWORD + "\n")
    path.chmod(0o600)
    return str(path)


def make_tier(url: str, **options) -> ValkeyTier:
    return ValkeyTier.from_options({"url": url, "key_prefix": unique_name("kv") + ":",
                                    "refresh_interval_s": 0, **options}, FINGERPRINT)


def client_options(authority, ca=None) -> dict:
    return {"tls_ca_file": ca or authority.ca_file, "tls_cert_file": authority.client_cert_file,
            "tls_key_file": authority.client_key_file}


def test_a_ca_file_and_a_client_certificate_connect_with_an_acl_user(tls_server, pki,
                                                                      tmp_path, caplog):
    good, _ = pki
    with caplog.at_level(logging.DEBUG):
        tier = make_tier(tls_server.url, username="carol", password_file=password_file(tmp_path),
                         **client_options(good))
        data = random_bytes(5000, 1)
        assert write(tier, [b"k"], [data]).ok
        out = torch.empty(5000, dtype=torch.uint8)
        assert read(tier, [b"k"], [out]).ok and torch.equal(out, data)
        tier.refresh()
        assert tier.lookup([b"k"]) == [True]
        shown = [repr(tier.config), repr(tier.stats()), tier.describe()]
        tier.close()
    with open(good.client_key_file) as f:
        key_text = f.read().splitlines()[1]
    text = "\n".join(shown + [r.getMessage() for r in caplog.records])
    assert USER_PASSWORD not in text and key_text not in text


@pytest.mark.parametrize("given", ["wrong CA", "client certificate of another CA",
                                   "no client certificate"])
def test_a_wrong_certificate_is_a_clear_start_up_error_naming_the_server(tls_server, pki,
                                                                         given):
    good, other = pki
    options = {"wrong CA": client_options(good, ca=other.ca_file),
               "client certificate of another CA": client_options(other, ca=good.ca_file),
               "no client certificate": {"tls_ca_file": good.ca_file}}[given]
    with pytest.raises(ConfigError) as error:
        make_tier(tls_server.url, connect_timeout_s=2.0, **options)
    message = str(error.value)
    assert tls_server.url.split("//")[1] in message and "TLS" in message


def test_a_wrong_password_over_tls_is_a_clear_start_up_error(tls_server, pki, tmp_path):
    good, _ = pki
    path = tmp_path / "wrong"
    path.write_text("not-the-password\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="refused the credentials") as error:
        make_tier(tls_server.url, username="carol", password_file=str(path),
                  **client_options(good))
    assert "not-the-password" not in str(error.value)


def test_tls_files_are_checked_at_start(tmp_path, pki):
    good, _ = pki
    with pytest.raises(ConfigError, match="tls_ca_file .* cannot be opened"):
        ValkeyTier.check_options({"url": "rediss://127.0.0.1:6380/0",
                                  "tls_ca_file": str(tmp_path / "absent.pem")})
    with pytest.raises(ConfigError, match="must start with rediss://"):
        ValkeyTier.check_options({"url": "redis://127.0.0.1:6379/0",
                                  "tls_ca_file": good.ca_file})
    with pytest.raises(ConfigError, match="go together"):
        ValkeyTier.check_options({"url": "rediss://127.0.0.1:6380/0",
                                  "tls_cert_file": good.client_cert_file})


def test_a_tls_cluster_is_reached_through_any_node_with_the_same_tls_options(pki):
    from kv_offload.backends.valkey.local_cluster import LocalCluster, cli_binary

    if cli_binary() is None:
        pytest.skip("no redis-cli on PATH (apt-get install -y redis-server)")
    good, other = pki
    tls = ServerTls(good.server_cert_file, good.server_key_file, good.ca_file,
                    good.client_cert_file, good.client_key_file)
    with LocalCluster(tls=tls) as cluster:
        tier = make_tier(cluster.nodes[-1].url, **client_options(good))
        assert tier._conn.cluster and cluster.url.startswith("rediss://")
        keys = [f"k{i}".encode() for i in range(30)]
        data = [random_bytes(5000, i) for i in range(30)]
        assert write(tier, keys, data).ok
        out = [torch.empty(5000, dtype=torch.uint8) for _ in keys]
        assert read(tier, keys, out).ok and all(torch.equal(o, d) for o, d in zip(out, data))
        tier.refresh()
        assert tier.lookup(keys) == [True] * 30
        tier.close()
        with pytest.raises(ConfigError, match="TLS"):
            make_tier(cluster.url, connect_timeout_s=2.0, **client_options(other,
                                                                           ca=good.ca_file))
