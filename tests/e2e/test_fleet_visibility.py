"""Two OpenAI-compatible servers on one Valkey server, as a fleet runs them.

Server B starts while the Valkey server is down (it starts in a key generation of its own:
it cannot tell which records are current) and then sits idle. The Valkey server comes back
(empty, as a restarted server would), server A starts and serves a prompt, storing it. Three
seconds later B is asked the same prompt: it must serve it from the store (cached tokens >=
the prompt's tokens less one block) with the tokens A produced. Without the connector's
find-before-first-lookup, an idle server's reports are as old as its last step; without
joining the fleet's generation once the store answers, B would never see A's records.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from kv_offload.serving.client import ServingClient
from kv_offload.serving.server import ServerSettings, VllmServer
from kv_offload.testing.tiny_vocab import word_prompt

from helpers.servers import new_secret_file

pytestmark = pytest.mark.e2e

BLOCK = 32
PROMPT = word_prompt(300, offset=1234)


def test_an_idle_server_started_during_an_outage_serves_what_another_stored(tiny_models,
                                                                           tmp_path):
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (pip install -e '.[dev]')")
    from kv_offload.backends.valkey.local_server import LocalServer, server_binary

    if server_binary() is None:
        pytest.skip("no Valkey/Redis server binary on PATH; the README's test command "
                    "installs Debian's redis-server")
    valkey = LocalServer(maxmemory="256mb")
    valkey.kill()  # (down: B starts during the outage)
    config = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {
                  "cpu_bytes_to_use": "64MiB", "storage_tier": "valkey",
                  "storage_options": {"url": valkey.url, "timeout_s": 1,
                                      "request_timeout_s": 2},
                  "secret_file": new_secret_file(tmp_path)}}
    settings = ServerSettings(model=str(tiny_models["llama"]), kv_transfer_config=config)
    try:
        with VllmServer(settings, tmp_path, name="b-idle") as b:
            with ServingClient(b.url) as client:  # (a first, long forward: see test_serving)
                client.complete(word_prompt(200, offset=9000), max_tokens=1, logprobs=1)
            valkey.start()
            with VllmServer(settings, tmp_path, name="a-busy") as a:
                with ServingClient(a.url) as client:
                    stored = client.complete(PROMPT, max_tokens=6, logprobs=1)
                time.sleep(3)  # (B runs no step meanwhile)
                with ServingClient(b.url) as client:
                    served = client.complete(PROMPT, max_tokens=6, logprobs=1)
                a.stop()
            b.stop()
    finally:
        valkey.stop()
    assert served.tokens == stored.tokens
    assert served.cached_tokens is not None
    assert served.cached_tokens >= served.prompt_tokens - BLOCK, served
