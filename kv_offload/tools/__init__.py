"""The `kv-offload` command and what it runs: tools around the library, not the library.

Contents:
- `cli`: the `kv-offload` entry point (subcommands `demo`, `inspect`, `bench`, `serve-check`).
- `demo`: the real vLLM engine with the connector over cold, CPU-tier and disk-tier passes.
- `inspect_cmd`: canonicalise the example models and show what would be offloaded.
- `bench`: `kv-offload bench`, its flags and the CPU backend's store/load benchmark.
- `bench_filesystem`: the filesystem tier against raw O_DIRECT I/O of the same bytes.
- `bench_tiers`: the shared-store tiers (Valkey, S3) against the filesystem tier.
- `bench_valkey_server`: `redis-benchmark`/`valkey-benchmark` as the server-alone baseline.
- `serve_check`: `kv-offload serve-check URL`, the command line of `kv_offload.serving.check`.

Nothing in the library imports this package: a user who only offloads never pays for it.
"""
