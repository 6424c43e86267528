"""One cache for every TP size, through real storage tiers: what TP=a ranks store, TP=b ranks
load as the pages vLLM holds at TP=b.

Each rank is a `TieredStore` (host slots, real copy threads) opened as the connector opens
it (`from_config` with `rank_records`: TP-free records under the shared fingerprint) over a
real filesystem directory, the session's loopback Valkey server, moto's S3 server, or the
example plug-in. Engine caches are allocated per rank as vLLM 0.32 allocates them and filled
by the oracle of `test_tp_pages_property` (vLLM's head assignment, through the engine's own
views). The TP=a ranks store every block and close; fresh TP=b ranks learn what is stored
from the tier's change feed only, must see exactly the blocks they can assemble (every head
they need), load them, and their whole engine buffers must equal the oracle's at TP=b.
"""

from __future__ import annotations

import time

import pytest
import torch

from kv_offload.backends.base import TierChanges
from kv_offload.backends.example import DictTier
from kv_offload.backends.filesystem import io_engine
from kv_offload.canonical import canonicalize
from kv_offload.config import parse_config
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.store.tp import tier as tp_tier
from kv_offload.store.tp.records import TPShare, rank_records
from kv_offload.testing.example_models import build_example, group_layers
from kv_offload.types import Location

from helpers.servers import shared_tier_options
from unit.store.tp.test_pages_property import (
    KV_HEADS,
    LOGICAL_BLOCKS,
    MODELS,
    Rank,
    expected_hits,
    make_rank,
    oracle_fill,
)

TP_SIZES = (1, 2, 4, 8)


def num_groups(name: str) -> int:
    return len(group_layers(MODELS[name]()))


def block_hash(r: Rank, group: int, logical: int) -> bytes:
    block_size, index = r.key(group, logical)  # the same tokens: the same hash at any TP
    return (block_size * 1000 + index).to_bytes(8, "little")


def open_rank(r: Rank, storage: dict, weights: str = "weights-A") -> TieredStore:
    """A rank's store as the connector opens it (see the module docstring)."""
    shape_fp = layout_fingerprint(r.canonical, f"{weights}|tp{r.tp}|rank{r.rank}")
    share = TPShare(weights, r.tp, r.rank, KV_HEADS[r.model.name])
    records = rank_records(r.canonical, r.model.kv_caches, r.model.groups, share, shape_fp)
    slot = max(r.canonical.slot_bytes_per_block(g) for g in range(len(r.model.groups)))
    slots = len(r.model.groups) * LOGICAL_BLOCKS  # (room for every block: no staging)
    config = parse_config({"cpu_bytes_to_use": slots * slot, **storage})
    return TieredStore.from_config(r.canonical, config, shape_fp, records=records)


def blocks_of(r: Rank, wanted) -> dict:
    groups: dict[int, tuple[list, list]] = {}
    for g, logical in sorted(wanted):
        hashes, ids = groups.setdefault(g, ([], []))
        hashes.append(block_hash(r, g, logical))
        ids.append(r.block_ids[g][logical])
    return groups


def store_all(name: str, tp: int, storage: dict, seed: int, ranks=None, **kw) -> None:
    order = list(range(num_groups(name) * LOGICAL_BLOCKS + 1))
    every = {(g, i) for g in range(len(order) // LOGICAL_BLOCKS) for i in range(LOGICAL_BLOCKS)}
    for rank in ranks if ranks is not None else range(tp):
        w = make_rank(name, tp, rank, "LBNHC" if rank % 2 else "LBHNC", None, order)
        oracle_fill(w, seed, every)
        store = open_rank(w, storage, **kw)
        [stored] = store.wait([store.submit_store(blocks_of(w, every))])
        assert stored.success and store.flush()
        store.close()


def visible(store: TieredStore, r: Rank, every, want, timeout_s: float = 10.0) -> set:
    """The blocks the store's change feed shows in the storage tier: polled until `want`
    shows (or the timeout), then a few polls more (nothing else may show up)."""
    keys = {(g, i): (block_hash(r, g, i), g) for g, i in every}

    def seen() -> set:
        store.poll()
        return {b for b, k in keys.items() if store.lookup([k]) == [Location.STORAGE]}

    deadline = time.monotonic() + timeout_s
    while seen() != want and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(5):
        time.sleep(0.002)
        seen()
    return seen()


def load_and_check(name: str, a: int, b: int, storage: dict, seed: int, **kw) -> None:
    order = list(reversed(range(num_groups(name) * LOGICAL_BLOCKS + 1)))
    for rank in range(b):
        r = make_rank(name, b, rank, "LBNHC" if rank % 2 == 0 else "LBHNC", None, order)
        every = {(g, i) for g in range(len(r.model.groups)) for i in range(LOGICAL_BLOCKS)}
        want = {(g, i) for g, i in every if expected_hits(name, a, b, g)}
        store = open_rank(r, storage, **kw)
        assert visible(store, r, every, want) == want, f"TP={b} rank {rank} after TP={a}"
        if want:
            [loaded] = store.wait([store.submit_load(blocks_of(r, want))])
            assert loaded.success and loaded.from_storage == len(want)
        reference = make_rank(name, b, rank, "LBNHC" if rank % 2 == 0 else "LBHNC", None,
                              order)
        oracle_fill(reference, seed, want)
        assert torch.equal(r.model.buffer, reference.model.buffer), \
            f"TP={b} rank {rank}: engine bytes differ from vLLM's pages after TP={a} stored"
        store.close()


def fs(tmp_path) -> dict:
    return {"storage_tier": "filesystem",
            "storage_options": {"root_dir": str(tmp_path / "root"), "bytes_to_use": "1GiB"}}


# Every pair for a GQA model (heads split 8/4/2/1 ways); for the MLA latent (one record,
# written by rank 0 only) and a 2-head model (replicated at TP 4 and 8) the pairs that cross
# between replicated and split shapes (the property test covers every pair of the mapping).
CASES = [("llama-8b", a, TP_SIZES) for a in TP_SIZES] + [
    ("deepseek-mla", 2, (1, 2)), ("qwen2-1.5b", 8, (1, 2)), ("qwen2-1.5b", 1, (8,))]


@pytest.mark.parametrize(("name", "a", "reads"), CASES)
def test_blocks_stored_at_tp_a_on_disk_load_at_tp_b_as_vllm_pages(tmp_path, name, a, reads):
    store_all(name, a, fs(tmp_path), seed=a)
    for b in reads:
        load_and_check(name, a, b, fs(tmp_path), seed=a)


@pytest.mark.parametrize(("name", "a", "b"), [("gemma3", 2, 1), ("gemma3", 1, 2),
                                              ("qwen3-next", 1, 1), ("qwen3-next", 2, 1)])
def test_hybrid_and_sliding_window_models_cross_tp_on_disk_where_vllm_allows(tmp_path, name,
                                                                              a, b):
    # (gemma3: both groups cross; qwen3-next: its GatedDeltaNet states stay per TP shape:
    # they load at their own shape and miss at another, where its attention blocks load)
    store_all(name, a, fs(tmp_path), seed=5)
    load_and_check(name, a, b, fs(tmp_path), seed=5)


@pytest.mark.parametrize(("backend", "a", "b"), [("valkey", 2, 1), ("valkey", 1, 4),
                                                 ("s3", 2, 1)])
def test_blocks_cross_tp_sizes_through_shared_servers(request, backend, a, b):
    name = "llama-8b"
    storage = {"storage_tier": backend,
               "storage_options": shared_tier_options(backend, request, "tp")}
    store_all(name, a, storage, seed=3)
    load_and_check(name, a, b, storage, seed=3)


class SharedDictTier(DictTier):
    """The example plug-in over a dict that every instance naming the same `store` shares
    (as processes share a server), its generation record included, with a change feed:
    what the dict held when the instance opened, then its own writes."""

    STORES: dict[str, dict] = {}
    GENERATIONS: dict[str, bytes] = {}

    def __init__(self, store: str) -> None:
        super().__init__()
        self._name = store
        self._data = self.STORES.setdefault(store, {})
        self._feed = list(self._data)

    def read_generation(self) -> bytes | None:
        return self.GENERATIONS.get(self._name)

    def write_generation(self, record: bytes) -> bool:
        self.GENERATIONS[self._name] = bytes(record)
        return True

    def create_generation(self, record: bytes) -> bytes | None:
        return self.GENERATIONS.setdefault(self._name, bytes(record))

    def _store(self, key: bytes, buf: torch.Tensor) -> bool:
        ok = super()._store(key, buf)
        self._feed += [key] if ok else []
        return ok

    def take_changes(self, max_keys: int) -> TierChanges:
        with self._lock:
            added, self._feed = self._feed[:max_keys], self._feed[max_keys:]
        return TierChanges(tuple(added))


def test_blocks_cross_tp_sizes_through_a_plug_in_tier():
    storage = {"storage_tier": f"{__name__}:SharedDictTier",
               "storage_options": {"store": "tp-plug-in"}}
    store_all("llama-8b", 4, storage, seed=4)
    load_and_check("llama-8b", 4, 2, storage, seed=4)
    load_and_check("llama-8b", 4, 1, storage, seed=4)


def test_a_block_counts_as_stored_only_when_every_head_a_rank_needs_is(tmp_path):
    store_all("llama-8b", 2, fs(tmp_path), seed=9, ranks=[0])  # rank 1's heads never stored
    order = list(range(LOGICAL_BLOCKS + 1))
    every = {(0, i) for i in range(LOGICAL_BLOCKS)}
    for tp, rank, sees in [(1, 0, set()), (2, 0, every), (2, 1, set()), (4, 1, every),
                           (4, 2, set()), (8, 3, every), (8, 4, set())]:
        r = make_rank("llama-8b", tp, rank, "LBHNC", None, order)
        store = open_rank(r, fs(tmp_path))
        assert visible(store, r, every, sees) == sees, f"TP={tp} rank {rank}"
        if not sees:  # a load of a block not covered fails without touching the engine
            before = r.model.buffer.clone()
            [loaded] = store.wait([store.submit_load(blocks_of(r, every))])
            assert not loaded.success and torch.equal(r.model.buffer, before)
        store.close()


def test_a_model_with_other_weights_is_never_served(tmp_path):
    store_all("llama-8b", 2, fs(tmp_path), seed=2, weights="weights-A")
    for tp in (1, 2):
        r = make_rank("llama-8b", tp, 0, "LBHNC", None, list(range(LOGICAL_BLOCKS + 1)))
        store = open_rank(r, fs(tmp_path), weights="weights-B")
        assert visible(store, r, {(0, 0), (0, 1)}, set()) == set()
        store.close()


def spy_record_buffers(monkeypatch) -> list[int]:
    """Sizes of the record buffers the TP layer and the filesystem tier allocate from now
    on (the real allocators, wrapped)."""
    allocated: list[int] = []
    for module, name in ((io_engine, "aligned_host_buffer"), (tp_tier, "aligned_buffer")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda n, real=real: allocated.append(n) or real(n))
    return allocated


def open_example(layout: str, blocks: int, tmp_path, threads: int = 2):
    """Rank 0 of 4 of the Llama-3-8B example (2 heads a rank) over a filesystem tier."""
    model = build_example("llama-8b", blocks, layout=layout, tp_size=4)
    canonical = canonicalize(model.kv_caches, model.groups, blocks)
    shape_fp = layout_fingerprint(canonical, f"weights|tp4|rank0|{layout}")
    records = rank_records(canonical, model.kv_caches, model.groups,
                           TPShare("weights", 4, 0, 8), shape_fp)
    config = parse_config({"cpu_bytes_to_use": blocks * canonical.slot_bytes_per_block(0),
                           "storage_tier": "filesystem", "storage_options": {
                               "root_dir": str(tmp_path), "bytes_to_use": "1GiB",
                               "io_threads": threads}})
    return model, TieredStore.from_config(canonical, config, shape_fp, records=records)


def wait_visible(store: TieredStore, hashes: list[bytes]) -> None:
    want = [(h, 0) for h in hashes]
    deadline = time.monotonic() + 10
    while store.lookup(want) != [Location.STORAGE] * len(hashes):
        assert time.monotonic() < deadline, "the stored blocks never showed"
        store.poll()


def move_in_jobs(store: TieredStore, op: str, hashes: list[bytes], per_job: int) -> None:
    for j in range(0, len(hashes), per_job):
        part = {0: (hashes[j:j + per_job], list(range(j, j + per_job)))}
        submit = store.submit_store if op == "store" else store.submit_load
        [result] = store.wait([submit(part)])
        assert result.success
    assert store.flush()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_a_rank_at_its_own_tp_size_stores_and_loads_its_pages_as_records_without_a_copy(
        tmp_path, monkeypatch, layout):
    # For both page layouts a rank's own record is its host slot's bytes (token-major for
    # LBNHC, vLLM's GPU default; head-major for LBHNC): no record buffer, no pack, no unpack.
    allocated = spy_record_buffers(monkeypatch)
    blocks = 6
    hashes = [i.to_bytes(8, "little") for i in range(blocks)]
    model, store = open_example(layout, blocks, tmp_path)
    model.buffer.copy_(torch.randint(-128, 128, model.buffer.shape, dtype=torch.int8))
    stored = model.buffer.clone()
    move_in_jobs(store, "store", hashes, blocks)
    store.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size
                   >= stored.numel() // blocks)
    assert len(files) == blocks  # (one record a block, as many values as plain pages)
    model, store = open_example(layout, blocks, tmp_path)
    wait_visible(store, hashes)
    move_in_jobs(store, "load", hashes, blocks)
    store.close()
    assert torch.equal(model.buffer, stored)
    assert allocated == [], f"{layout}: record buffers {allocated} allocated"


def test_records_of_the_other_order_move_through_one_buffer_per_io_thread(tmp_path,
                                                                          monkeypatch):
    # LBNHC records (token-major) loaded by an LBHNC rank are transposed into its slots by
    # the filesystem tier's I/O threads, each in a buffer of its own that it keeps: jobs of
    # more records than threads allocate no record buffer per record (fresh pages fault).
    allocated = spy_record_buffers(monkeypatch)
    blocks, jobs, threads = 12, 3, 2
    hashes = [i.to_bytes(8, "little") for i in range(blocks)]
    writer, store = open_example("LBNHC", blocks, tmp_path, threads)
    writer.buffer.copy_(torch.randint(-128, 128, writer.buffer.shape, dtype=torch.int8))
    move_in_jobs(store, "store", hashes, blocks)
    store.close()
    reader, store = open_example("LBHNC", blocks, tmp_path, threads)
    wait_visible(store, hashes)
    move_in_jobs(store, "load", hashes, blocks // jobs)  # (more records than I/O threads)
    store.close()
    assert 0 < len(allocated) <= threads, f"{len(allocated)} record buffers allocated"
    for name, cache in writer.kv_caches.items():  # the same values, in the reader's layout
        assert torch.equal(reader.kv_caches[name].view(torch.int16), cache.view(torch.int16)), \
            name  # (compared as bits: random bytes hold NaNs)
