"""Build a random-weight model directory that vLLM loads locally (no download).

    python benchmarks/make_tiny_model.py --arch llama --out /tmp/kvo-llama
    python benchmarks/make_tiny_model.py --arch llama --out /tmp/kvo-big \
        --layers 8 --hidden 1024 --heads 16 --kv-heads 4

Prompts for these models are words "w0 w1 ..." (`kv_offload.testing.tiny_vocab.word_prompt`).
The builders live in `kv_offload.testing.tiny_models`; this script only exposes them on the
command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kv_offload.testing.tiny_models import BUILDERS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(BUILDERS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--layers", type=int, help="number of decoder layers")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "kv_heads": args.kv_heads}
    kwargs = {k: v for k, v in sizes.items() if v is not None}
    path = BUILDERS[args.arch](args.out, seed=args.seed, **kwargs)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
