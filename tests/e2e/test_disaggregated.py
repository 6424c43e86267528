"""Prefill/decode disaggregation on the real vLLM CPU engine, through the proxy flow.

OpenAI-compatible servers as an operator starts them: a prefill server (`kv_producer`) and
a decode server (`kv_consumer`) sharing one store, `kv-offload proxy` in front of them, and 8
requests sent to the proxy at once. Each decode response must be the completion of a server
without the connector (the same greedy tokens), and the decode server must have served each
prompt from the store (cached tokens >= the prompt's tokens less one block: the decode
server never computed what the prefill server stored). Over a shared directory with the
prefill server at TP=2 and the decode server at TP=1 (TP-free records), and over Valkey
(with a `secret_file`, as a shared store requires).
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kv_offload.serving.client import Completion, ServingClient
from kv_offload.serving.server import ServerSettings, VllmServer
from kv_offload.testing.tiny_vocab import word_prompt

from helpers.servers import new_secret_file

pytestmark = pytest.mark.e2e

BLOCK, MAX_TOKENS, LOGPROBS = 32, 6, 1
PROMPTS = [word_prompt(130 + 23 * i, offset=90 * i) for i in range(8)]


def transfer_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": "64MiB", **extra}}


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory) -> list[Completion]:
    """A server without the connector, one prompt at a time."""
    work = tmp_path_factory.mktemp("pd-baseline")
    with VllmServer(ServerSettings(model=str(tiny_models["llama"])), work,
                    name="baseline") as server:  # (started on entry)
        with ServingClient(server.url) as client:
            completions = [client.complete(p, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
                           for p in PROMPTS]
        server.stop()
    return completions


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def through_the_proxy(model: Path, work: Path, extra: dict[str, Any],
                      prefill_args: tuple[str, ...] = (),
                      prefill_env: dict[str, str] | None = None) -> list[Completion]:
    prefill = VllmServer(ServerSettings(model=str(model), extra_args=prefill_args,
                                        env=prefill_env or {},
                                        kv_transfer_config=transfer_config("kv_producer",
                                                                           extra)),
                         work, name="prefill")
    decode = VllmServer(ServerSettings(model=str(model),
                                       kv_transfer_config=transfer_config("kv_consumer",
                                                                          extra)),
                        work, name="decode")
    with prefill, decode:  # (each started on entry)
        # A server's first forward must be long: on AMX CPUs a first prefill of a few tokens
        # (all a decode server computes after a hit) kills vLLM's CPU worker with SIGILL.
        with ServingClient(decode.url) as client:
            client.complete(word_prompt(200, offset=5000), max_tokens=1, logprobs=1)
        port = free_port()
        with open(work / "proxy.log", "wb") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "kv_offload.tools.cli", "proxy", "--prefill",
                 prefill.url, "--decode", decode.url, "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            with ServingClient(url) as client:
                while not client.health():
                    assert proxy.poll() is None and time.monotonic() < deadline, \
                        (work / "proxy.log").read_text()
                    time.sleep(0.5)
                with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all 8 at once
                    return list(pool.map(lambda p: client.complete(
                        p, max_tokens=MAX_TOKENS, logprobs=LOGPROBS), PROMPTS))
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
            decode.stop()
            prefill.stop()


def check(served: list[Completion], baseline: list[Completion]) -> None:
    assert [c.tokens for c in served] == [c.tokens for c in baseline]
    for completion in served:
        assert completion.cached_tokens is not None
        assert completion.cached_tokens >= completion.prompt_tokens - BLOCK, completion


def test_p_at_tp2_and_d_at_tp1_over_a_shared_directory(tiny_models, tmp_path, baseline):
    extra = {"storage_tier": "filesystem",
             "storage_options": {"root_dir": str(tmp_path / "kv"), "bytes_to_use": "256MiB"}}
    served = through_the_proxy(tiny_models["llama"], tmp_path, extra,
                               ("--tensor-parallel-size", "2"),
                               # (vLLM CPU binds each TP worker's threads: one core each)
                               {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    check(served, baseline)


def test_p_and_d_over_valkey(tiny_models, tmp_path, baseline):
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (pip install -e '.[dev]')")
    from kv_offload.backends.valkey.local_server import LocalServer, server_binary

    if server_binary() is None:
        pytest.skip("no Valkey/Redis server binary on PATH; the README's test command "
                    "installs Debian's redis-server")
    with LocalServer(maxmemory="256mb") as valkey:
        extra = {"storage_tier": "valkey", "storage_options": {"url": valkey.url},
                 "secret_file": new_secret_file(tmp_path)}
        served = through_the_proxy(tiny_models["llama"], tmp_path, extra)
    check(served, baseline)
