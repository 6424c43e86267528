"""Prefill/decode disaggregation through a shared store: what it costs and what it saves.

Four OpenAI-compatible vLLM servers (the CPU build here), started as an operator would:
one server doing both phases (no connector), a prefill server (`kv_producer`) and a decode
server (`kv_consumer`) sharing a disk directory, and `kv-offload proxy` in front of the
last two. For every measurement a fresh prompt of `--prompt-tokens` words (no cache anywhere
holds it), greedy, streamed, `--max-tokens` generated; side by side in one run:

  one server          TTFT of the server doing both (its prefill, then its first token)
  decode recomputes   TTFT of the decode server sent the prompt without a promise: it
                      computes the prompt itself (P/D without a working KV transfer)
  prefill             the prefill server's answer (`max_tokens: 1`, `do_remote_decode`)
  decode served       TTFT of the decode server sent the prompt with that answer's
                      `kv_transfer_params`: it loads the prompt's KV from the store
  P/D pipeline        TTFT through the proxy: prefill, then decode, as a client sees it

Medians over `--repeats` x `--prompts` measurements (each case on its own fresh prompts).
Every measurement starts `--pause-s` after the last one ended, so that each server is as
idle as the others when it is asked (three vLLM CPU servers share the cores; a server asked
right after another one worked measured up to a second slower, whatever the case). The
model is a random-weight Llama of `--layers` x `--hidden` (its prefill must cost something
for loading it to be worth anything).

    python benchmarks/bench_pd.py --json bench-pd.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kv_offload.serving.server import ServerSettings, VllmServer
from kv_offload.testing.tiny_models import build_llama
from kv_offload.testing.tiny_vocab import word_prompt


def transfer_config(role: str, root: Path) -> dict[str, Any]:
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": "256MiB", "storage_tier": "filesystem",
                "storage_options": {"root_dir": str(root), "bytes_to_use": "2GiB"}}}


def ttft(url: str, model: str, prompt: str, max_tokens: int,
         params: dict[str, Any] | None = None) -> tuple[float, int | None]:
    """Seconds to the first generated text of a streamed completion, and cached tokens."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if params is not None:
        body["kv_transfer_params"] = params
    started, first, cached = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", cached)
    return first if first is not None else time.perf_counter() - started, cached


def prefill(url: str, model: str, prompt: str) -> tuple[float, dict[str, Any] | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started, reply.json().get("kv_transfer_params")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pause-s", type=float, default=1.5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    model = str(build_llama(work / "llama", layers=args.layers, hidden=args.hidden,
                            heads=args.hidden // 64, kv_heads=args.hidden // 128,
                            max_positions=4096))
    settings = {"model": model, "max_model_len": 4096, "kv_cache_memory_bytes": 256 << 20}
    counter = iter(range(10**6))

    def fresh() -> str:  # (a prompt no server has seen)
        return word_prompt(args.prompt_tokens, offset=7919 * next(counter))

    times: dict[str, list[float]] = {}
    cached: dict[str, list[int | None]] = {}

    def add(case: str, seconds: float, hit: int | None = None) -> None:
        times.setdefault(case, []).append(seconds)
        cached.setdefault(case, []).append(hit)
        time.sleep(args.pause_s)

    one = VllmServer(ServerSettings(**settings), work, name="one-server")
    p = VllmServer(ServerSettings(**settings, kv_transfer_config=transfer_config(
        "kv_producer", work / "kv")), work, name="prefill")
    d = VllmServer(ServerSettings(**settings, kv_transfer_config=transfer_config(
        "kv_consumer", work / "kv")), work, name="decode")
    with one, p, d:
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "kv_offload.tools.cli", "proxy",
                                  "--prefill", p.url, "--decode", d.url, "--port", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proxy_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{proxy_url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy did not start")
                time.sleep(0.5)
            ttft(one.url, model, fresh(), args.max_tokens)  # (warm-up: first requests)
            ttft(d.url, model, fresh(), args.max_tokens)
            prefill(p.url, model, fresh())
            for _ in range(args.repeats):
                for _ in range(args.prompts):
                    add("one server", *ttft(one.url, model, fresh(), args.max_tokens))
                    add("decode recomputes", *ttft(d.url, model, fresh(), args.max_tokens))
                    prompt = fresh()
                    seconds, params = prefill(p.url, model, prompt)
                    add("prefill", seconds)
                    add("decode served", *ttft(d.url, model, prompt, args.max_tokens, params))
                    add("P/D pipeline", *ttft(proxy_url, model, fresh(), args.max_tokens))
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    rows = [{"case": case, "median_s": statistics.median(values), "runs_s": values,
             "cached_tokens": cached[case]} for case, values in times.items()]
    print(f"{args.prompt_tokens}-word prompts, {args.max_tokens} tokens generated; medians of "
          f"{args.repeats} x {args.prompts}")
    print(f"{'case':20} {'median s':>9}   cached tokens (median)")
    for row in rows:
        hits = [c for c in row["cached_tokens"] if c is not None]
        print(f"{row['case']:20} {row['median_s']:9.3f}   "
              f"{statistics.median(hits) if hits else '-'}")
    by = {row["case"]: row["median_s"] for row in rows}
    print(f"decode served / decode recomputes: {by['decode served'] / by['decode recomputes']:.2f}"
          f"; P/D pipeline / one server: {by['P/D pipeline'] / by['one server']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
