"""`kv-offload check-config`: the connector's start-up checks, in seconds and without vLLM."""

from __future__ import annotations

import io
import json
import time

import pytest

from kv_offload.tools.cli import main

from helpers.servers import new_secret_file


def check(capsys, *args: str) -> tuple[int, list[str]]:
    status = main(["check-config", *args])
    return status, capsys.readouterr().out.strip().splitlines()


def test_a_typo_fails_with_the_engines_error_naming_the_nearest_key(capsys):
    status, lines = check(capsys, '{"cpu_byte_to_use": "16GiB"}')
    assert status == 1
    assert lines[-1].startswith("ConfigError: unknown key(s) ['cpu_byte_to_use']")
    assert "did you mean 'cpu_bytes_to_use'?" in lines[-1]


def test_a_good_config_prints_what_an_engine_would_set_up(capsys, tmp_path):
    config = {"cpu_bytes_to_use": "1GiB", "storage_tier": "filesystem",
              "storage_options": {"root_dir": str(tmp_path / "kv"), "bytes_to_use": "2GiB"},
              "model_identity": "deploy-7"}
    status, lines = check(capsys, json.dumps(config))
    assert status == 0 and lines[-1] == "ok: every start-up check passed"
    assert "host tier     1.0 GiB per worker rank" in lines
    assert "storage tier  filesystem" in lines
    assert any("deploy-7" in line for line in lines)


def test_the_whole_transfer_config_is_checked_from_a_file_or_stdin(capsys, tmp_path,
                                                                  monkeypatch):
    transfer = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": "1GiB"}}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(transfer))
    status, lines = check(capsys, str(path))
    assert status == 1 and "set it to 'kv_offload.vllm'" in lines[-1]
    transfer["kv_connector_module_path"] = "kv_offload.vllm"
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(transfer)))
    status, lines = check(capsys, "-")
    assert status == 0
    assert any("kv_load_failure_policy" in line for line in lines)  # (a note, not an error)


def test_json_that_does_not_parse_is_a_usage_error(capsys):
    assert main(["check-config", "{not json"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_an_unreachable_valkey_server_fails_within_its_timeouts(capsys, tmp_path):
    config = {"cpu_bytes_to_use": "1GiB", "storage_tier": "valkey",
              "storage_options": {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.5,
                                  "request_timeout_s": 1},
              "secret_file": new_secret_file(tmp_path)}
    started = time.monotonic()
    status, lines = check(capsys, json.dumps(config))
    assert status == 1 and "cannot be reached" in lines[-1]
    assert time.monotonic() - started < 10
    status, lines = check(capsys, json.dumps(config), "--offline")
    assert status == 0


def test_a_reachable_valkey_server_passes_and_no_secret_is_printed(capsys, tmp_path,
                                                                   valkey_server):
    pytest.importorskip("redis")
    secret = new_secret_file(tmp_path)
    config = {"cpu_bytes_to_use": "1GiB", "storage_tier": "valkey",
              "storage_options": {"url": valkey_server.url, "key_prefix": "check:"},
              "secret_file": secret, "encrypt": True}
    status, lines = check(capsys, json.dumps(config))
    assert status == 0, lines
    assert any(line.startswith("storage tier") and "reachable" in line for line in lines)
    assert any("encrypted" in line for line in lines)
    with open(secret, "rb") as f:
        raw = f.read()
    output = "\n".join(lines)
    assert raw.hex() not in output and raw.decode("latin-1") not in output


def test_a_shared_store_without_a_secret_is_refused_before_any_connection(capsys):
    config = {"cpu_bytes_to_use": "1GiB", "storage_tier": "valkey",
              "storage_options": {"url": "redis://127.0.0.1:1/0"}}
    status, lines = check(capsys, json.dumps(config))
    assert status == 1 and "secret_file" in lines[-1]
