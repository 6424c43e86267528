"""Online serving: vLLM's OpenAI-compatible server with KVOffloadConnector, seen from outside.

Contents:
- `server`: `VllmServer` starts `python -m vllm.entrypoints.openai.api_server` on a free
  loopback port in its own process group and stops it, reporting orphaned processes by pid
  (`ServerSettings`, `ShutdownReport`); for tests and benchmarks.
- `client`: `ServingClient` (greedy completions with logprobs through the official `openai`
  client; `/health`, `/tokenize`, `/metrics`, `/reset_prefix_cache`), `stream_completion`
  (with time to first token), `Completion`, `compare_outputs`.
- `metrics`: `parse_metrics` reads the connector's `vllm:kv_offload_*` counters and vLLM's
  own cache counters from a `/metrics` scrape (`OffloadCounters`, `ServerMetrics`).
- `check`: the client-side verification behind `kv-offload serve-check URL` (`run_check`).
- `record`: the file `serve-check --record` writes and `--replay` reads (`load_record`).
- `pd_proxy`: the prefill/decode proxy behind `kv-offload proxy` (`create_app`,
  `build_server`, `ProxySettings`): prefill with one token and `do_remote_decode`, then
  decode with the returned `kv_transfer_params`, streamed back.
- the command lines, `kv-offload serve-check` and `kv-offload proxy`, live in
  `kv_offload.tools.serve_check` and `kv_offload.tools.proxy_cmd`.

Nothing here imports vLLM: the client side runs wherever the server can be reached, and
`server` only starts vLLM in a child process. Submodules are imported on use, so
`import kv_offload.serving` needs none of openai, httpx, prometheus_client, psutil,
starlette or uvicorn.
"""
