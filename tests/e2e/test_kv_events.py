"""KV events of our tiers on the real vLLM CPU engine, through vLLM's own ZMQ publisher.

The engine runs with `kv_events_config` (ZMQ publisher, loopback) beside a tiny host tier
and a tiny disk budget; a subscriber in this process decodes the batches with its own
msgspec structs, as a router does (vLLM's wire format: `[ts, events, dp_rank]`, events
tagged by class name). After a prompt is stored, the subscriber must see its block hashes,
the very hashes and tokens vLLM announces for its own ("GPU") blocks, in the "CPU" and
"STORAGE" media; after later prompts push it out of the host tier and the disk budget, their
removal from both.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_harness import ENGINE_BLOCK_SIZE, run_engine

from kv_offload.testing.tiny_vocab import word_prompt

zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.e2e

TOPIC = "kv-offload-test"
BLOCK_BYTES = 2 * 32 * 2 * (32 + 32) * 2  # tiny llama: 2 layers x 32 tokens x 2 heads x K+V x bf16
PROMPTS = [word_prompt(100), word_prompt(200, offset=100), word_prompt(200, offset=300),
           word_prompt(40, offset=50)]


class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A SUB socket bound on loopback (vLLM's publisher connects to a non-wildcard
    endpoint), receiving (topic, seq, payload) frames on a thread until stopped."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.batches: list[tuple[int, Batch]] = []  # (sequence number, batch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._decoder = msgspec.msgpack.Decoder(type=Batch)

    def __enter__(self) -> Subscriber:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()

    def _receive(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                topic, seq, payload = self._sock.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"),
                                     self._decoder.decode(payload)))


@pytest.fixture(scope="module")
def events_run(tiny_models, tmp_path_factory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("kv_events")
    with Subscriber() as subscriber:
        spec = {
            "model": str(tiny_models["llama"]), "max_tokens": 4, "prompts": PROMPTS,
            # After each prompt: its write-through to disk ends while the engine idles (the
            # workers report at steps), then a prompt shorter than a block (it stores and
            # evicts nothing) makes the engine step, so the report shows where it is.
            "passes": [{"prompts": [prompt], "settle_s": 1.0,
                        "settle_prompt": word_prompt(6, offset=900)} for prompt in PROMPTS],
            "linger_s": 2.0,
            "engine_args": {
                "kv_transfer_config": {
                    "kv_connector": "KVOffloadConnector",
                    "kv_connector_module_path": "kv_offload.vllm", "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "cpu_bytes_to_use": 4 * BLOCK_BYTES,  # 4 blocks: prompt 1 is evicted
                        "storage_tier": "filesystem", "storage_options": {
                            "root_dir": str(work / "kv"),
                            # room for about 7 block files: prompts 2 and 3 push prompt 1 out
                            "bytes_to_use": 7 * (BLOCK_BYTES + 8192)}}},
                "kv_events_config": {
                    "enable_kv_cache_events": True, "publisher": "zmq", "topic": TOPIC,
                    "endpoint": f"tcp://127.0.0.1:{subscriber.port}"}},
        }
        result = run_engine(spec, work / "engine")
    batches = sorted(subscriber.batches, key=lambda b: b[0])
    return {"result": result, "events": [(seq, e) for seq, b in batches for e in b.events]}


def first_prompt_blocks(events_run) -> list[list[int]]:
    tokens = events_run["result"]["passes"][0]["requests"][0]["prompt_token_ids"]
    full = len(tokens) // ENGINE_BLOCK_SIZE
    return [tokens[i * ENGINE_BLOCK_SIZE:(i + 1) * ENGINE_BLOCK_SIZE] for i in range(full)]


def gpu_hashes(events_run, blocks: list[list[int]]) -> list[int | bytes]:
    """vLLM's own hashes of `blocks` (a prefix chain), from its "GPU" store events."""
    by_tokens: dict[tuple, tuple] = {}
    for _, event in events_run["events"]:
        if isinstance(event, Stored) and event.medium == "GPU":
            for i, block_hash in enumerate(event.block_hashes):
                parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                chunk = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                by_tokens[(parent, tuple(chunk))] = block_hash
    chain, parent = [], None
    for block in blocks:
        parent = by_tokens[(parent, tuple(block))]
        chain.append(parent)
    return chain


def ours(events_run, kind, medium) -> list[tuple[int, Any]]:
    return [(seq, e) for seq, e in events_run["events"]
            if isinstance(e, kind) and e.medium == medium]


def test_a_stored_prompt_is_announced_in_host_memory_with_vllms_own_hashes_and_tokens(
        events_run):
    blocks = first_prompt_blocks(events_run)
    hashes = gpu_hashes(events_run, blocks)
    assert len(hashes) == 3
    stored = {e.block_hashes[0]: e for _, e in ours(events_run, Stored, "CPU")}
    for i, block_hash in enumerate(hashes):
        event = stored[block_hash]
        assert event.token_ids == blocks[i]
        assert event.parent_block_hash == (hashes[i - 1] if i else None)
        assert (event.block_size, event.group_idx, event.ownership) == (ENGINE_BLOCK_SIZE, 0,
                                                                         None)


def test_a_written_through_prompt_is_announced_in_the_storage_medium_while_in_host_memory(
        events_run):
    blocks = first_prompt_blocks(events_run)
    hashes = gpu_hashes(events_run, blocks)
    stored = {e.block_hashes[0]: (seq, e) for seq, e in ours(events_run, Stored, "STORAGE")}
    host_removed_at = {h: seq for seq, e in ours(events_run, Removed, "CPU")
                       for h in e.block_hashes}
    for i, block_hash in enumerate(hashes):
        seq, event = stored[block_hash]
        assert (event.token_ids, event.ownership) == (blocks[i], "filesystem")
        assert seq < host_removed_at[block_hash]  # the write-through, not the eviction


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_an_evicted_prompt_is_removed_after_it_was_stored(events_run, medium):
    hashes = gpu_hashes(events_run, first_prompt_blocks(events_run))
    stored_at = {e.block_hashes[0]: seq for seq, e in ours(events_run, Stored, medium)}
    removed_at = {h: seq for seq, e in ours(events_run, Removed, medium)
                  for h in e.block_hashes}
    for block_hash in hashes:
        assert removed_at[block_hash] > stored_at[block_hash]


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_every_removal_follows_a_store_of_the_same_block(events_run, medium):
    """What a router's index relies on: per block and medium, stored and removed alternate,
    starting with stored."""
    held: set = set()
    removals = 0
    for _, event in events_run["events"]:
        if getattr(event, "medium", None) != medium:  # (AllBlocksCleared has no medium)
            continue
        for block_hash in event.block_hashes:
            if isinstance(event, Stored):
                assert block_hash not in held
                held.add(block_hash)
            else:
                held.remove(block_hash)
                removals += 1
    assert removals >= 3

