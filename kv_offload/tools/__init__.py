"""The `kv-offload` command and what it runs: tools around the library, not the library.

Contents:
- `cli`: the `kv-offload` entry point (subcommands `demo`, `inspect`, `bench`, `serve-check`,
  `secret`).
- `demo`: the real vLLM engine with the connector over cold, CPU-tier and disk-tier passes.
- `inspect_cmd`: canonicalise the example models and show what would be offloaded.
- `report`: what every subcommand shows and writes: `Table`, the JSON `envelope`, `Progress`.
- `bench`: `kv-offload bench`: the flags every tier shares, which it honours, the refusals.
- `bench_cpu`: the host tier's store/load copies against a plain torch copy.
- `bench_tiers`: the harness for storage tiers (cells of value size x connections).
- `bench_filesystem`: the filesystem tier against raw O_DIRECT I/O of the same bytes.
- `bench_stores`: Valkey, S3 or any `module:Class` tier against the filesystem tier.
- `bench_valkey_server`: `redis-benchmark`/`valkey-benchmark` as the server-alone baseline.
- `secret_cmd`: `kv-offload secret new PATH`: a new secret file (mode 0600, never overwrites).
- `serve_check`: `kv-offload serve-check URL`, the command line of `kv_offload.serving.check`.

Nothing in the library imports this package: a user who only offloads never pays for it.
"""
