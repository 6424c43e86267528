"""Lossless codecs on real KV pages: compression ratio and GB/s per core, side by side.

How: pages come from the real vLLM CPU engine. ``--model DIR`` (a model directory, e.g. from
``make_tiny_model.py``) runs the engine in a child process with the disk tier on
(``fs_root_dir``) over prompts of ``--prompt-tokens`` words, and the records that tier wrote
are the pages measured (``--pages-dir DIR`` reuses such a directory). Each codec compresses
and decompresses every page on one thread (blosc2 with ``nthreads=1``): GB/s are bytes of
page per second per core, medians over ``--repeats`` runs; the ratio is stored bytes over
page bytes (lower is better). Every round trip is checked byte for byte.

The fp8 rows come from a second engine run with ``kv_cache_dtype="fp8"`` (vLLM 0.32's CPU
attention keeps an fp8 e4m3 cache on x86 with AVX-512 or AMX), without the connector, which
refuses quantised caches: its written blocks are read from the workers' caches (one layer's
block per page; ``--fp8-pages`` reuses a saved ``.npy``). Each table also runs blosc2's bit
shuffle at the other value width (``typesize``), to show what a codec tuned for one dtype
does to the other.

Why these codecs: a bf16 value's high byte (sign and exponent) takes few values, its low
byte (mantissa) is close to random. A byte-plane split (all high bytes, then all low bytes)
lets an entropy coder squeeze the exponents; without it zstd sees interleaved noise.
blosc2 does the split (its shuffle filter, typesize-aware) and the coding in one C call.

    python benchmarks/make_tiny_model.py --arch llama --out /tmp/llama --layers 4 \
        --hidden 1024 --heads 16 --kv-heads 4
    python benchmarks/bench_compression.py --model /tmp/llama --json compression.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ENGINE_CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from kv_offload.testing.tiny_vocab import word_prompt
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], block_size=32, max_model_len=2048, enforce_eager=True,
          dtype="bfloat16", seed=0, enable_prefix_caching=True,
          kv_cache_memory_bytes=256 << 20,
          kv_transfer_config={"kv_connector": "KVOffloadConnector",
                              "kv_connector_module_path": "kv_offload.vllm",
                              "kv_role": "kv_both",
                              "kv_connector_extra_config": {
                                  "cpu_bytes_to_use": 512 << 20,
                                  "fs_root_dir": spec["root"],
                                  "fs_bytes_to_use": 4 << 30}})
prompts = [word_prompt(spec["tokens"], offset=97 * i) for i in range(spec["prompts"])]
llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
del llm
"""


FP8_CHILD = r"""
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
from kv_offload.testing.tiny_vocab import word_prompt
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], block_size=32, max_model_len=2048, enforce_eager=True,
          dtype="bfloat16", seed=0, enable_prefix_caching=True, kv_cache_dtype="fp8",
          kv_cache_memory_bytes=256 << 20)
prompts = [word_prompt(spec["tokens"], offset=97 * i) for i in range(spec["prompts"])]
llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)

def written_pages(worker):
    pages = []
    for cache in worker.model_runner.kv_caches:  # (uint8 [blocks, heads, tokens, K|V])
        for block in cache.view(-1, cache[0].numel()):
            if block.any():
                pages.append(block.numpy().copy())
    return pages[: spec["limit"]]

np.save(spec["out"], np.stack(llm.collective_rpc(written_pages)[0]))
"""


def collect_fp8_pages(model: str, out: str, tokens: int, prompts: int, limit: int) -> None:
    """Run the vLLM CPU engine with an fp8 KV cache (no connector: kv-offload refuses
    quantised caches today) and save the written blocks of its layers' caches to ``out``."""
    spec = json.dumps({"model": model, "out": out, "tokens": tokens, "prompts": prompts,
                       "limit": limit})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, "-c", FP8_CHILD, spec], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def collect_pages(model: str, root: str, tokens: int, prompts: int) -> None:
    """Run the vLLM CPU engine over ``prompts`` prompts with the disk tier at ``root``."""
    spec = json.dumps({"model": model, "root": root, "tokens": tokens, "prompts": prompts})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, "-c", ENGINE_CHILD, spec], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def read_pages(root: str, limit: int) -> list[bytes]:
    """The data of every record under ``root`` (at most ``limit``)."""
    from kv_offload.backends.filesystem.fileformat import SUFFIX, parse_header

    pages = []
    for path in sorted(Path(root).rglob(f"*{SUFFIX}")):
        blob = path.read_bytes()
        info = parse_header(blob)
        pages.append(blob[info.data_offset:info.data_offset + info.data_len])
        if len(pages) >= limit:
            break
    if not pages:
        raise SystemExit(f"no records under {root}")
    return pages


def split_planes(page: bytes, typesize: int) -> bytes:
    return np.frombuffer(page, np.uint8).reshape(-1, typesize).T.tobytes()


def join_planes(planes: bytes, typesize: int) -> bytes:
    return np.frombuffer(planes, np.uint8).reshape(typesize, -1).T.tobytes()


def codecs(typesize: int) -> dict[str, tuple[Callable, Callable]]:
    other = 3 - typesize  # (2 for fp8, 1 for bf16)
    """name -> (compress(page) -> bytes, decompress(payload, n) -> bytes)."""
    import blosc2
    import lz4.block
    import zstandard

    blosc2.set_nthreads(1)
    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def blosc(codec, filt, clevel=1, typesize=typesize):
        def c(page):
            return blosc2.compress2(page, typesize=typesize, clevel=clevel, codec=codec,
                                    filters=[filt], nthreads=1)
        return c, lambda payload, n: blosc2.decompress2(payload)

    return {
        "zstd-1": (zc.compress, lambda p, n: zd.decompress(p, max_output_size=n)),
        "zstd-1 + byte planes": (
            lambda page: zc.compress(split_planes(page, typesize)),
            lambda p, n: join_planes(zd.decompress(p, max_output_size=n), typesize)),
        "lz4 + byte planes": (
            lambda page: lz4.block.compress(split_planes(page, typesize), store_size=False),
            lambda p, n: join_planes(lz4.block.decompress(p, uncompressed_size=n), typesize)),
        "blosc2 shuffle+zstd-1": blosc(blosc2.Codec.ZSTD, blosc2.Filter.SHUFFLE),
        "blosc2 shuffle+lz4": blosc(blosc2.Codec.LZ4, blosc2.Filter.SHUFFLE, clevel=5),
        "blosc2 bitshuffle+lz4": blosc(blosc2.Codec.LZ4, blosc2.Filter.BITSHUFFLE, clevel=5),
        f"  (same, typesize {other})": blosc(blosc2.Codec.LZ4, blosc2.Filter.BITSHUFFLE,
                                             clevel=5, typesize=other),
    }


def measure(pages: list[bytes], typesize: int, repeats: int) -> list[dict]:
    total = sum(len(p) for p in pages)
    rows = []
    for name, (compress, decompress) in codecs(typesize).items():
        c_times, d_times = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            payloads = [compress(p) for p in pages]
            t1 = time.perf_counter()
            outs = [decompress(c, len(p)) for c, p in zip(payloads, pages)]
            t2 = time.perf_counter()
            c_times.append(t1 - t0)
            d_times.append(t2 - t1)
            if any(bytes(o) != p for o, p in zip(outs, pages)):
                raise AssertionError(f"{name}: round trip is not bit-exact")
        rows.append({
            "codec": name,
            "ratio": sum(len(c) for c in payloads) / total,
            "compress_gbps": total / statistics.median(c_times) / 1e9,
            "decompress_gbps": total / statistics.median(d_times) / 1e9,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory: run the vLLM CPU engine for pages")
    parser.add_argument("--pages-dir", help="a disk tier directory already holding records")
    parser.add_argument("--fp8-pages", help="an .npy of fp8 pages a previous run saved")
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-pages", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not (args.model or (args.pages_dir and args.fp8_pages)):
        parser.error("give --model (run the engine), or --pages-dir and --fp8-pages (reuse "
                     "what a run saved)")
    with tempfile.TemporaryDirectory(prefix="kvo-compression-") as tmp:
        root = args.pages_dir or os.path.join(tmp, "bf16")
        fp8_path = args.fp8_pages or os.path.join(tmp, "fp8.npy")
        if args.model:
            collect_pages(args.model, root, args.prompt_tokens, args.prompts)
            if not args.fp8_pages:
                collect_fp8_pages(args.model, fp8_path, args.prompt_tokens, args.prompts,
                                  args.max_pages)
        bf16 = read_pages(root, args.max_pages)
        fp8 = [row.tobytes() for row in np.load(fp8_path)]
    results = {"tables": {}}
    for label, data, typesize in (("bf16 (engine pages)", bf16, 2),
                                  ("fp8 e4m3 (engine pages, kv_cache_dtype fp8)", fp8, 1)):
        rows = measure(data, typesize, args.repeats)
        results["tables"][label] = rows
        print(f"\n{label}: {len(data)} pages of {len(data[0])} bytes, "
              f"medians of {args.repeats} runs, one core")
        print(f"{'codec':<24} {'stored/page':>11} {'compress GB/s':>14} {'decompress GB/s':>16}")
        for r in rows:
            print(f"{r['codec']:<24} {r['ratio']:>11.3f} {r['compress_gbps']:>14.2f} "
                  f"{r['decompress_gbps']:>16.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
