"""`kv-offload serve-check`: bad arguments and bad `--replay` records get a clear, typed error
before any request; an unreachable server is a failed check, not a traceback."""

from __future__ import annotations

import json

import pytest

from kv_offload.errors import ServeCheckInputError
from kv_offload.serving.client import Completion
from kv_offload.serving.record import RECORD_FORMAT, RECORD_VERSION, load_record
from kv_offload.serving.server import free_loopback_port
from kv_offload.tools.cli import main

OUTPUT = Completion(prompt_tokens=100, cached_tokens=96, tokens=("token_id:7",),
                    top_logprobs=({"token_id:7": -1.5},), seconds=0.2).to_json()


def record(**changes: object) -> dict:
    good = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "model": "m",
            "block_size": 32, "max_tokens": 1, "logprobs": 1, "prompts": [[5] * 100],
            "recompute": [OUTPUT], "reference": [OUTPUT]}
    good.update(changes)
    return {k: v for k, v in good.items() if v is not None}


def test_a_good_record_loads(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record()))
    loaded = load_record(path, "m")
    assert loaded.prompts == [[5] * 100] and loaded.reference[0].cached_tokens == 96
    assert (loaded.max_tokens, loaded.logprobs) == (1, 1)


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read a JSON record"),
    (json.dumps([1, 2]), "not a serve-check record"),
    (json.dumps(record(format="something-else")), "not a serve-check record"),
    (json.dumps(record(version=99)), "record version 99"),
    (json.dumps(record(model="other")), "recorded against model 'other'.*serves 'm'"),
    (json.dumps(record(reference=None)), "bad or missing field 'reference'"),
    (json.dumps(record(max_tokens="many")), "bad or missing field"),
    (json.dumps(record(prompts=[[1], [2]])), "2 prompts but 1 recompute and 1 reference"),
])
def test_a_bad_record_is_refused_naming_the_problem(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ServeCheckInputError, match=message):
        load_record(path, "m")


def test_a_missing_record_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ServeCheckInputError, match="nope.json: cannot read"):
        load_record(tmp_path / "nope.json", "m")


@pytest.mark.parametrize("args, message", [
    (["--prompts", "0"], "--prompts must be at least 1, got 0"),
    (["--prompt-tokens", "-5"], "--prompt-tokens must be at least 1, got -5"),
    (["--logprob-tolerance", "-1"], "--logprob-tolerance must be >= 0"),
    (["--timeout-s", "0"], "--timeout-s must be positive"),
])
def test_bad_arguments_exit_2_with_the_option_named(capsys, args, message):
    assert main(["serve-check", "http://127.0.0.1:9", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_server_is_a_failed_check(tmp_path, capsys):
    pytest.importorskip("openai")
    url = f"http://127.0.0.1:{free_loopback_port()}"  # nothing listens there
    out = tmp_path / "report.json"
    assert main(["serve-check", url, "--timeout-s", "5", "--json", str(out)]) == 1
    document = json.loads(out.read_text())
    assert document["command"] == "serve-check"
    report = document["results"]
    assert report["passed"] is False
    assert report["checks"] == [{"name": "server", "passed": False,
                                 "detail": f"GET {url}/health does not answer 200"}]
    assert "FAILED" in capsys.readouterr().out
