"""The S3 tier's client: its botocore resolves the endpoint once per bucket, not per object
key (the `s3` extra requires such a botocore), and an older one gets one clear warning."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

import botocore.endpoint_provider  # noqa: E402

from kv_offload.backends.common.options import parse_options  # noqa: E402
from kv_offload.backends.s3 import client as s3_client  # noqa: E402
from kv_offload.backends.s3.config import S3TierConfig  # noqa: E402

from helpers.servers import make_bucket  # noqa: E402


def test_puts_of_new_keys_do_not_evaluate_the_endpoint_rules_again(s3_server, monkeypatch):
    config = parse_options(S3TierConfig, {"bucket": make_bucket(s3_server.endpoint_url),
                                          "endpoint_url": s3_server.endpoint_url,
                                          "bytes_to_use": 1 << 20},
                           tier="s3", layout_fingerprint="client-test")
    s3 = s3_client.make_client(config)
    s3.put_object(Bucket=config.bucket, Key="first", Body=b"x")  # (resolves it once)
    evaluations = []
    rules = botocore.endpoint_provider.RuleSet  # (botocore's rule set: counted, not changed)
    evaluate = rules.evaluate
    monkeypatch.setattr(rules, "evaluate",
                        lambda self, params: evaluations.append(1) or evaluate(self, params))
    for i in range(20):
        s3.put_object(Bucket=config.bucket, Key=f"block-{i}", Body=b"x", IfNoneMatch="*")
    assert len(evaluations) == 0, f"the endpoint rules ran {len(evaluations)} times for 20 " \
        f"new keys: this botocore ({botocore.__version__}) resolves per key"


@pytest.mark.parametrize("version", ["1.36.0", "1.43.11", "1.43.13"])
def test_a_botocore_that_resolves_per_key_gets_advice_naming_the_fixed_release(version):
    advice = s3_client.endpoint_cache_advice(version)
    assert advice is not None and version in advice and "1.43.14" in advice


@pytest.mark.parametrize("version", ["1.43.14", "1.43.127", "1.44.8", "2.0.0", "1.45.0dev1"])
def test_a_botocore_with_the_fix_gets_no_advice(version):
    assert s3_client.endpoint_cache_advice(version) is None


def test_the_advice_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(s3_client.botocore, "__version__", "1.43.11")
    monkeypatch.setattr(s3_client, "_advised", False)
    config = parse_options(S3TierConfig, {"bucket": "advice-test", "bytes_to_use": 1 << 20,
                                          "endpoint_url": "http://127.0.0.1:9"},
                           tier="s3", layout_fingerprint="client-test")
    with caplog.at_level(logging.WARNING, logger=s3_client.__name__):
        s3_client.make_client(config)
        s3_client.make_client(config)
    assert [r.getMessage() for r in caplog.records].count(
        s3_client.endpoint_cache_advice("1.43.11")) == 1
