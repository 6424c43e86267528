"""`kv-offload bench --tier host`: the host tier's store/load copies, checked byte for byte.

Build an example model's kv_caches (or a synthetic one with `--page-kib` pages), canonicalise,
then repeat: the baselines (one plain torch copy of the same number of bytes, engine to pool
for the store and pool to engine for the load), a store job and a load job of a realistic
batch (engine block ids a random subset, out of order; slots as a fresh manager hands them
out, or scattered with `--pattern scattered`). The best of the repeats is compared, all
measured side by side in one run. Then every byte is verified: the slots hold the blocks' real
bytes, nothing else in the pool changed, the loaded blocks hold them again and nothing else
in the engine changed. A job that fails counts its blocks as failed keys.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.canonical import CanonicalKVCaches, canonicalize
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.testing.example_models import build_example
from kv_offload.tools.report import Progress, Table

MIB = 1 << 20
DEFAULT_MODEL, DEFAULT_LAYOUT, DEFAULT_BATCH_MIB = "llama-8b", "LBNHC", 256
POOL_FILL, ENGINE_FILL = 0x33, 0x5A  # what untouched bytes must still hold
# Pause before each timed phase: after torch's parallel copy its OpenMP threads keep
# spinning on the cores for milliseconds, which would slow whatever runs next.
SETTLE_S = 0.05


@dataclass(frozen=True)
class Model:
    name: str
    kv_caches: dict
    groups: list[KVCacheGroup]
    num_blocks: int
    buffer: torch.Tensor


def synthetic_model(page_kib: int, layers: int, num_blocks: int, layout: str,
                    device: str = "cpu") -> Model:
    """One full-attention group of `layers` layers whose pages are `page_kib` KiB
    (16 bf16 tokens; 128-wide heads when the size allows, else one narrower head)."""
    if page_kib <= 0 or layers <= 0:
        raise ValueError(f"--page-kib and --layers must be positive, got {page_kib}, {layers}")
    heads, head = (page_kib // 8, 128) if page_kib % 8 == 0 else (1, 16 * page_kib)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head,
                             dtype=torch.bfloat16)
    groups = [KVCacheGroup([f"layer.{i}" for i in range(layers)], spec)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout, device=device)
    return Model(f"synthetic-{page_kib}KiB-x{layers}", caches, groups, num_blocks, buffer)


def build_model(args: argparse.Namespace) -> tuple[Model, CanonicalKVCaches, int]:
    """The model, its canonical view, and blocks per group for a batch of --batch-mib."""
    def sized(make: Callable[[int], Model]) -> tuple[Model, CanonicalKVCaches, int]:
        probe = make(1)
        probe_view = canonicalize(probe.kv_caches, probe.groups, 1)
        per_block = sum(probe_view.data_bytes_per_block(g) for g in range(len(probe.groups)))
        per_group = max(4, int(batch_mib(args) * MIB) // per_block)
        model = make(2 * per_group * len(probe.groups))  # room for gaps and other targets
        return model, canonicalize(model.kv_caches, model.groups, model.num_blocks), per_group

    layout, device = args.layout or DEFAULT_LAYOUT, engine_device(args)
    if args.page_kib is not None:
        (page_kib,) = args.page_kib
        return sized(lambda n: synthetic_model(page_kib, args.layers or 1, n, layout,
                                               device))
    return sized(lambda n: example_model(args.model or DEFAULT_MODEL, n, layout, device))


def engine_device(args: argparse.Namespace) -> str:
    return getattr(args, "device", None) or "cpu"


def batch_mib(args: argparse.Namespace) -> float:
    return DEFAULT_BATCH_MIB if args.batch_mib is None else args.batch_mib


def example_model(name: str, num_blocks: int, layout: str, device: str = "cpu") -> Model:
    m = build_example(name, num_blocks, layout=layout, device=device)
    return Model(m.name, m.kv_caches, m.groups, m.num_blocks, m.buffer)


def fill_pattern(buffer: torch.Tensor) -> None:
    """Every 8-byte word distinct: a misplaced page cannot go unnoticed."""
    words = buffer.view(torch.int64)
    torch.arange(words.numel(), out=words).mul_(0x9E3779B97F4A7C15 - (1 << 64))


def bench_cpu(args: argparse.Namespace) -> dict:
    from kv_offload.store.host import HostTier

    rng = np.random.default_rng(args.seed)
    model, canonical, per_group = build_model(args)
    pattern = args.pattern or "fresh"
    groups = range(len(model.groups))
    slots_needed = per_group * len(model.groups)
    num_slots = slots_needed * (2 if pattern == "scattered" else 1)
    slot_bytes = max(canonical.slot_bytes_per_block(g) for g in groups)
    host_tier = HostTier(canonical, num_slots * slot_bytes)
    failed = FailedBlocks()
    try:
        fill_pattern(model.buffer)
        host_tier.pool.fill_(POOL_FILL)  # touch every page before timing anything
        blocks = rng.permutation(model.num_blocks)  # a block belongs to one group at a time
        targets = rng.permutation(model.num_blocks)
        slots = (np.arange(slots_needed) if pattern == "fresh"
                 else rng.permutation(num_slots)[:slots_needed])
        stores = {g: (blocks[g::len(groups)][:per_group], slots[g::len(groups)])
                  for g in groups}
        loads = {g: (targets[g::len(groups)][:per_group], slots[g::len(groups)]) for g in groups}
        plan = host_tier.copier.plan(_direction("store"), stores)
        total = plan.num_bytes
        engine = model.buffer.view(-1)[:total]
        pool = host_tier.pool.view(-1)[:total]
        times: dict[str, list[float]] = {name: [] for name in FIGURES}
        progress = Progress(args.repeats, f"bench cpu {model.name}")
        for rep in range(args.repeats):
            progress.step(f"repeat {rep + 1}")
            times["baseline_store"].append(_timed_copy(pool, engine))
            time.sleep(SETTLE_S)
            times["store"].append(_run_job(host_tier, host_tier.submit_store, stores, failed))
            times["baseline_load"].append(_timed_copy(engine, pool))
            time.sleep(SETTLE_S)
            times["load"].append(_run_job(host_tier, host_tier.submit_load, loads, failed))
        progress.finish()
        fill_pattern(model.buffer)
        mismatches = _verify(host_tier, canonical, model, stores, loads, failed)
        strategies = {d: list(host_tier.copier.last_strategies(_direction(d)))
                      for d in ("store", "load")}
    finally:
        host_tier.close()
    samples = {f"{k}_gbps": [total / t / 1e9 for t in v] for k, v in times.items()}
    best = {k: max(v) for k, v in samples.items()}
    refs = canonical.group_refs[0]
    return {
        "tier": "host", "model": model.name, "layout": args.layout or DEFAULT_LAYOUT,
        "pattern": pattern, "seed": args.seed,
        "baseline": "one torch copy of the same bytes (engine to pool; pool to engine)",
        **best,
        "store_ratio": best["store_gbps"] / best["baseline_store_gbps"],
        "load_ratio": best["load_gbps"] / best["baseline_load_gbps"],
        # (each repeat's job against its own baseline, timed just before it: on a shared
        # machine the bests of the two can come from different moments)
        **{f"{d}_ratio_median": float(np.median(np.divide(samples[f"{d}_gbps"],
                                                          samples[f"baseline_{d}_gbps"])))
           for d in ("store", "load")},
        "mismatches": mismatches, "failed_keys": failed.count,
        "page_bytes": refs[0].page_size_bytes, "layers_per_group": len(refs),
        "groups": len(model.groups), "blocks": per_group * len(model.groups),
        "batch_bytes": total, "repeats": args.repeats, "samples": samples,
        "strategies": strategies, "torch_threads": torch.get_num_threads(),
        "device": _device_name(model.buffer),
    }


# Timed phases, in the order each repeat runs them.
FIGURES = ("baseline_store", "store", "baseline_load", "load")


@dataclass
class FailedBlocks:
    """Blocks of failed jobs (a failed job's blocks are the bench's failed keys)."""

    count: int = 0


def _direction(name: str):
    from kv_offload.transfer import Direction

    return Direction(name)


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    time.sleep(SETTLE_S)
    _synchronize(dst, src)
    start = time.perf_counter()
    dst.copy_(src)
    _synchronize(dst, src)  # a GPU copy to or from pinned memory may return early
    return time.perf_counter() - start


def _synchronize(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)


def _run_job(host_tier, submit, transfers, failed: FailedBlocks) -> float:
    """Submit one job, wait for it; its wall time (queueing included)."""
    start = time.perf_counter()
    # After the engine's work so far, as the connector submits (GPU: an event on the
    # current stream; CPU: nothing to wait for).
    (result,) = host_tier.wait([submit(transfers, ready=host_tier.engine_ready())])
    elapsed = time.perf_counter() - start
    if not result.success:
        failed.count += sum(len(blocks) for _, blocks in result.failed_blocks) or sum(
            len(blocks) for blocks, _ in transfers.values())
    return elapsed


def _block_index(canonical: CanonicalKVCaches, blocks) -> torch.Tensor:
    """Block ids as an index on the engine's device (a GPU tensor takes a GPU index)."""
    return torch.from_numpy(np.asarray(blocks)).to(canonical.tensors[0].tensor.device)


def _slot_offsets(canonical: CanonicalKVCaches, group: int) -> list[int]:
    return np.cumsum([0] + [r.slot_bytes for r in canonical.group_refs[group]])[:-1].tolist()


def _verify(host_tier, canonical: CanonicalKVCaches, model: Model, stores, loads,
            failed: FailedBlocks) -> int:
    """Wrong bytes after one more store and load, checked through the canonical
    refs directly (not through the copier's fused views)."""
    pool = host_tier.pool
    pool.fill_(POOL_FILL)
    _run_job(host_tier, host_tier.submit_store, stores, failed)
    bad = 0
    for g, (blocks, slots) in stores.items():
        b, s = _block_index(canonical, blocks), torch.from_numpy(host_tier.pool_rows(slots))
        for ref, off in zip(canonical.group_refs[g], _slot_offsets(canonical, g)):
            engine = canonical.tensors[ref.tensor_idx].tensor
            page = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
            host = slice(off, off + ref.page_size_bytes)
            bad += int((pool[s, host] != engine[b, page].cpu()).sum())
            pool[s, host] = POOL_FILL
    bad += int((pool != POOL_FILL).sum())  # padding and unused slots untouched
    _run_job(host_tier, host_tier.submit_store, stores, failed)
    model.buffer.fill_(ENGINE_FILL)
    _run_job(host_tier, host_tier.submit_load, loads, failed)
    for g, (blocks, slots) in loads.items():
        b, s = _block_index(canonical, blocks), torch.from_numpy(host_tier.pool_rows(slots))
        for ref, off in zip(canonical.group_refs[g], _slot_offsets(canonical, g)):
            engine = canonical.tensors[ref.tensor_idx].tensor
            page = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
            bad += int((engine[b, page].cpu() != pool[s, off:off + ref.page_size_bytes]).sum())
            engine[b, page] = ENGINE_FILL
    return bad + int((model.buffer != ENGINE_FILL).sum())  # nothing else written


def _device_name(buffer: torch.Tensor) -> str:
    if buffer.device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(buffer.device)}"
    return "cpu"


def cpu_table(r: dict) -> Table:
    table = Table(
        f"kv-offload bench: tier=host ({r['device']}) model={r['model']} layout={r['layout']} "
        f"pattern={r['pattern']}: {r['blocks']} blocks in {r['groups']} group(s), "
        f"{r['layers_per_group']} layers x {r['page_bytes']} B pages, "
        f"{r['batch_bytes'] / MIB:.1f} MiB per job, best of {r['repeats']}",
        ("", "GB/s", "baseline GB/s", "ratio", "median ratio", "strategy"))
    for d in ("store", "load"):
        table.add(d, r[f"{d}_gbps"], r[f"baseline_{d}_gbps"], r[f"{d}_ratio"],
                  r[f"{d}_ratio_median"], ",".join(r["strategies"][d]))
    table.notes.append(f"baseline: {r['baseline']}; median ratio: the median over the runs "
                       f"of each job's ratio to the baseline timed just before it")
    table.notes.append(f"mismatches: {r['mismatches']}   failed keys: {r['failed_keys']}")
    return table
