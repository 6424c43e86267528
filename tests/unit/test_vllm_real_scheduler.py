"""vLLM's own Scheduler drives the connector's scheduler side; this test plays the model runner.

What is real: vLLM's `Scheduler` (`vllm.v1.core.sched.scheduler`), built from real vLLM config
classes over a tiny local Llama directory (`build_llama`, no download) and a `KVCacheConfig`
from vLLM's own `get_kv_cache_configs`. The Scheduler creates `KVOffloadConnector` itself
from `kv_transfer_config` (scheduler role), asks it for hits, moves requests through
`WAITING_FOR_REMOTE_KVS`, builds its metadata every step and feeds it the workers' output.
The worker side is our real `OffloadWorker` with a real host tier, registered on caches laid
out the way vLLM allocates them (`allocate_kv_caches`), copying on its own threads.

What the test plays: the model runner and the worker-role connector's routing. Per step it
does what vLLM's runner and `KVOffloadConnector` do, in vLLM's order (handle_preemptions,
start_load_kv, forward, wait_for_save, get_transfer_results, build_connector_worker_meta),
and hands vLLM a real `ModelRunnerOutput` with a `KVConnectorOutput`. Its "forward" computes
nothing: it writes bytes derived from (layer, token id, position) into each scheduled token's
slot and samples a fixed token, so the test can tell loaded bytes from anything else.

Scenario: request A runs to completion and its full blocks are stored; vLLM's prefix cache is
reset and the engine's memory scribbled over; request B with A's prompt gets a hit from our
connector, waits for its load in WAITING_FOR_REMOTE_KVS, and runs with every full block but
the last token's already computed, holding A's bytes; after `reset_prefix_cache(
reset_connector=True)` request C with the same prompt misses and is computed from scratch.

vLLM 0.32 and 0.33 differ where noted (`VLLM_033`); the Scheduler's constructor, Request,
SchedulerOutput fields read here and ModelRunnerOutput / KVConnectorOutput are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm  # noqa: E402
from packaging.version import Version  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kv_offload.config import parse_config  # noqa: E402
from kv_offload.testing.engine_alloc import allocate_kv_caches  # noqa: E402
from kv_offload.testing.tiny_models import build_llama  # noqa: E402
from kv_offload.testing.tiny_vocab import VOCAB_SIZE  # noqa: E402
from kv_offload.vllm.connector import KVOffloadConnector  # noqa: E402
from kv_offload.vllm.metadata import KVOffloadMetadata  # noqa: E402
from kv_offload.vllm.spec_translation import translate_groups  # noqa: E402
from kv_offload.vllm.worker_side import OffloadWorker  # noqa: E402

VLLM_033 = Version(vllm.__version__).release >= (0, 33)

BLOCK = 32  # engine block size (vLLM's CPU attention needs a multiple of 32)
LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 32  # build_llama's defaults: hidden 128 / 4 heads
NUM_BLOCKS = 64
PROMPT_LEN = 200  # 6 full blocks and 8 tokens
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK  # whole blocks, never the last token: 192
MAX_TOKENS = 3
EXTRA_CONFIG = {"cpu_bytes_to_use": 8 << 20}
STEP_DEADLINE_S = 10.0  # loads and stores run on the worker's threads: wait this long at most


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("real_scheduler") / "llama")


def _vllm_config(model_dir) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16",
                        max_model_len=1024, seed=0)
    transfer = KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kv_offload.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=EXTRA_CONFIG)
    return VllmConfig(model_config=model,
                      cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                      kv_transfer_config=transfer)


def _kv_cache_config(vllm_config: VllmConfig):
    """The engine core's KV-cache planning (EngineCore._initialize_kv_caches) for one CPU
    worker whose attention layers are the tiny Llama's, with memory for NUM_BLOCKS blocks:
    (the worker's config, the scheduler's config)."""
    register_all_kvcache_specs(vllm_config)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}]
    memory = [NUM_BLOCKS * LAYERS * spec.page_size_bytes]
    # The layouts the CPU worker's attention backend reports; recorded on cache_config.
    supported = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
    resolve_kv_cache_layout(vllm_config, [supported], specs[0].values())
    if VLLM_033:
        # vLLM 0.33 moved the planning to kv_cache_planning and groups the layers first.
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )

        configs = get_kv_cache_configs(vllm_config, specs, memory,
                                       get_global_kv_cache_groups(vllm_config, specs))
    else:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        configs = get_kv_cache_configs(vllm_config, specs, memory)
    for config in configs:
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    worker_config = configs[0]
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    return worker_config, scheduler_config


def _slot_bytes(layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the played forward writes for these tokens: [H, len(tokens), K|V] in bfloat16,
    small integers (exact in bfloat16) mixing layer, head, token id, position and lane."""
    lanes = torch.arange(2 * HEAD_SIZE)
    heads = torch.arange(KV_HEADS)
    mixed = (layer * 101 + heads[:, None, None] * 31 + tokens[None, :, None] * 7
             + positions[None, :, None] * 13 + lanes[None, None, :])
    return (mixed % 251 - 125).to(torch.bfloat16)


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]  # the single full-attention group's block table
    num_computed: int


@dataclass
class _Step:
    """One engine step: what vLLM scheduled, our metadata in it, and the loads the worker
    reported finished to vLLM."""

    output: SchedulerOutput
    meta: KVOffloadMetadata
    finished_recving: set[str]


class PlayedModelRunner:
    """vLLM's model runner and worker-role connector, minus the model: the real
    `OffloadWorker` behind the calls `KVOffloadConnector` makes for vLLM's runner."""

    def __init__(self, worker_kv_cache_config) -> None:
        groups = translate_groups(worker_kv_cache_config)
        self.num_blocks = worker_kv_cache_config.num_blocks
        self.buffer, self.caches = allocate_kv_caches(
            groups, self.num_blocks, layout=worker_kv_cache_config.kv_cache_layout)
        self.layer_names = list(self.caches)
        self.worker = OffloadWorker(parse_config(EXTRA_CONFIG), rank=0,
                                    fingerprint_extra="test_vllm_real_scheduler")
        self.worker.register(self.caches, groups, self.num_blocks)
        self.requests: dict[str, _RunnerRequest] = {}

    def execute(self, scheduler_output: SchedulerOutput
                ) -> tuple[KVOffloadMetadata, ModelRunnerOutput]:
        meta = scheduler_output.kv_connector_metadata
        assert isinstance(meta, KVOffloadMetadata), type(meta).__name__
        # handle_preemptions: before anything of the step
        self.worker.step_started()
        if meta.wait_for_stores:
            self.worker.wait_for_engine_copies()
        self._update_states(scheduler_output)
        # vLLM starts synchronous loads before the forward, asynchronous ones after it
        # (kv_connector_model_runner_mixin); ours are all asynchronous.
        assert not scheduler_output.has_sync_kv_loads
        sampled = self._forward(scheduler_output)
        # start_load_kv
        self.worker.begin_step(meta.step)
        if meta.reset:
            self.worker.reset()
        self.worker.start_loads(meta.loads, meta.failed_loads)
        # wait_for_save
        self.worker.start_stores(meta.stores)
        # get_transfer_results, then build_connector_worker_meta
        finished, failed = self.worker.finished_loads()
        kv_output = KVConnectorOutput(finished_recving=finished or None,
                                      failed_recving=failed,
                                      kv_connector_worker_meta=self.worker.report())
        if not scheduler_output.total_num_scheduled_tokens:
            # (the runner's kv_connector_no_forward)
            return meta, ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        req_ids = list(sampled)
        return meta, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], kv_connector_output=kv_output)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """The runner's persistent batch: token ids and block tables (vLLM sends new
        requests whole, running ones as the blocks added since the last step)."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            (block_ids,) = new.block_ids
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids), list(block_ids), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if cached.new_block_ids[i] is not None:
                state.block_ids.extend(cached.new_block_ids[i][0])
            state.num_computed = cached.num_computed_tokens[i]
        for block_id in scheduler_output.new_block_ids_to_zero or ():
            for name in self.layer_names:
                self.caches[name][block_id].zero_()

    def _forward(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Write each scheduled token's slot; sample a fixed token where a prompt ends."""
        sampled = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed, state.num_computed + num_tokens
            positions = torch.arange(start, end)
            tokens = torch.tensor(state.token_ids[start:end])
            blocks = torch.tensor([state.block_ids[p // BLOCK] for p in range(start, end)])
            for layer, name in enumerate(self.layer_names):
                # [B, H, N, C] -> one slot per token: block, all heads, offset in block
                self.caches[name][blocks, :, positions % BLOCK] = \
                    _slot_bytes(layer, tokens, positions).permute(1, 0, 2)
            sampled[req_id] = []
            if end >= len(state.token_ids):  # the last known token: sample the next
                # (a word token, never a special one: only max_tokens ends the request)
                token = 4 + (len(state.token_ids) * 17) % (VOCAB_SIZE - 4)
                state.token_ids.append(token)
                sampled[req_id] = [token]
        return sampled

    def block_bytes(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every layer's pages of these blocks, copied."""
        return [self.caches[name][block_ids].clone() for name in self.layer_names]

    def expected_bytes(self, token_ids: list[int], num_blocks: int) -> list[torch.Tensor]:
        """What the forward wrote for the first `num_blocks` blocks of these tokens."""
        n = num_blocks * BLOCK
        tokens, positions = torch.tensor(token_ids[:n]), torch.arange(n)
        return [_slot_bytes(layer, tokens, positions)  # [H, n, C] -> [blocks, H, BLOCK, C]
                .reshape(KV_HEADS, num_blocks, BLOCK, -1).permute(1, 0, 2, 3)
                for layer in range(LAYERS)]

    def scribble(self) -> None:
        """Overwrite all of engine memory (other requests reusing every block)."""
        self.buffer.fill_(0x55)

    def shutdown(self) -> None:
        self.worker.shutdown()


class Engine:
    """EngineCore.step's loop over the real Scheduler and the played runner."""

    def __init__(self, vllm_config: VllmConfig, worker_kv_cache_config,
                 scheduler_kv_cache_config) -> None:
        block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, vllm_config)
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
        self.runner = PlayedModelRunner(worker_kv_cache_config)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn)

    def add(self, req_id: str, prompt: list[int]) -> Request:
        request = Request(req_id, prompt, SamplingParams(max_tokens=MAX_TOKENS), None,
                          block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> _Step:
        output = self.scheduler.schedule()
        meta, runner_output = self.runner.execute(output)
        self.scheduler.update_from_output(output, runner_output)
        kv_output = runner_output.kv_connector_output
        return _Step(output, meta, set(kv_output.finished_recving or ()) if kv_output else set())

    def step_until(self, done: Callable[[_Step], bool], what: str) -> list[_Step]:
        """Step until `done(last step)`; the worker's copies get up to STEP_DEADLINE_S."""
        steps, deadline = [], time.monotonic() + STEP_DEADLINE_S
        while not steps or not done(steps[-1]):
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {len(steps)} steps")
            steps.append(self.step())
            if not steps[-1].output.total_num_scheduled_tokens:
                time.sleep(0.001)  # the worker's threads copy meanwhile
        return steps


@pytest.fixture
def engine(llama_dir):
    vllm_config = _vllm_config(llama_dir)
    worker_config, scheduler_config = _kv_cache_config(vllm_config)
    engine = Engine(vllm_config, worker_config, scheduler_config)
    yield engine
    engine.runner.shutdown()


PROMPT = [4 + (i * 37) % (VOCAB_SIZE - 4) for i in range(PROMPT_LEN)]
FULL_BLOCKS = HIT_TOKENS // BLOCK


def _scheduled_new(step: _Step, req_id: str):
    """vLLM's NewRequestData of `req_id` in this step, or None."""
    return next((new for new in step.output.scheduled_new_reqs if new.req_id == req_id), None)


def _stored(steps: list[_Step]) -> list[tuple[bytes, int]]:
    """(block hash, block id) of every block the steps' metadata told the worker to store."""
    return [pair for step in steps for hashes, ids in step.meta.stores.values()
            for pair in zip(hashes, ids)]


@dataclass
class _Stored:
    """Request A, run to completion: its steps, full blocks and their bytes."""

    request: Request
    steps: list[_Step]
    block_ids: list[int]
    block_bytes: list[torch.Tensor]


def _run_a(engine: Engine) -> _Stored:
    """(1) A runs to completion; its full blocks are stored."""
    a = engine.add("A", PROMPT)
    steps = engine.step_until(lambda s: a.is_finished(), "A finished")
    block_ids = engine.runner.requests["A"].block_ids[:FULL_BLOCKS]
    return _Stored(a, steps, block_ids, engine.runner.block_bytes(block_ids))


def _forget_in_engine(engine: Engine) -> None:
    """(2) vLLM forgets its own copy; empty steps carry the worker's reports to the
    scheduler; every block is overwritten, so only a load can bring A's bytes back."""
    assert engine.scheduler.reset_prefix_cache()
    for _ in range(3):
        engine.step()
    engine.runner.scribble()


@dataclass
class _Loaded:
    """Request B with A's prompt: the step that looked it up (and B's state right after
    it), then the steps until vLLM ran it."""

    request: Request
    asked: _Step
    status_when_asked: RequestStatus
    computed_when_asked: int
    block_ids_when_asked: list[int]
    steps: list[_Step]


def _load_b(engine: Engine) -> _Loaded:
    """(3) B, A's prompt: looked up, loaded, then run."""
    b = engine.add("B", PROMPT)
    asked = engine.step_until(lambda s: b.status != RequestStatus.WAITING, "B looked up")[-1]
    status, computed = b.status, b.num_computed_tokens
    block_ids = engine.scheduler.kv_cache_manager.get_block_ids("B")[0]
    steps = engine.step_until(lambda s: "B" in s.output.num_scheduled_tokens, "B scheduled")
    return _Loaded(b, asked, status, computed, block_ids, steps)


def test_vllm_runs_a_request_whose_full_blocks_the_connector_stores(engine):
    print(f"vLLM {vllm.__version__} from {vllm.__file__}")  # (shown with -rP)
    assert isinstance(engine.scheduler.get_kv_connector(), KVOffloadConnector)
    assert engine.scheduler.recompute_kv_load_failures
    a = _run_a(engine)
    # Until the worker's first report our connector cannot answer (vLLM asks again): the
    # first step runs no forward and only carries that report back.
    assert a.steps[0].output.total_num_scheduled_tokens == 0
    prefill = a.steps[1]
    first = _scheduled_new(prefill, "A")
    assert first is not None and first.num_computed_tokens == 0
    assert prefill.output.num_scheduled_tokens["A"] == PROMPT_LEN
    # The prefill's forward completed 6 blocks (the 7th is partial): those are stored, once.
    assert _stored([prefill]) == [(bytes(h), i) for h, i in
                                  zip(a.request.block_hashes[:FULL_BLOCKS], a.block_ids)]
    assert _stored(a.steps) == _stored([prefill])
    assert a.request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(a.request.output_token_ids) == MAX_TOKENS
    for got, want in zip(a.block_bytes, engine.runner.expected_bytes(PROMPT, FULL_BLOCKS)):
        assert torch.equal(got, want)


def test_a_request_with_a_stored_prefix_waits_for_its_load_then_runs_from_the_hit(engine):
    a = _run_a(engine)
    _forget_in_engine(engine)
    loaded = _load_b(engine)
    b, asked, steps = loaded.request, loaded.asked, loaded.steps

    # Our connector's hit: vLLM allocates B's blocks, counts the hit as computed and parks
    # B until the load reports back; the load plan goes to the worker in that very step.
    assert loaded.status_when_asked == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "B" not in asked.output.num_scheduled_tokens
    assert loaded.computed_when_asked == HIT_TOKENS  # (vLLM counts the hit before it arrives)
    b_blocks = loaded.block_ids_when_asked[:FULL_BLOCKS]
    (plan,) = asked.meta.loads["B"].values()
    assert plan == ([bytes(h) for h in b.block_hashes[:FULL_BLOCKS]], b_blocks)

    # The worker reported the load finished; vLLM then ran B from the hit on: all full
    # blocks, never the last prompt token.
    assert sum("B" in s.finished_recving for s in [asked, *steps]) == 1
    ran = _scheduled_new(steps[-1], "B")
    assert ran is not None and ran.num_computed_tokens == HIT_TOKENS
    assert ran.block_ids[0][:FULL_BLOCKS] == b_blocks
    assert steps[-1].output.num_scheduled_tokens["B"] == PROMPT_LEN - HIT_TOKENS
    # The forward wrote only from the hit on: B's full blocks hold what the load put there.
    for got, want in zip(engine.runner.block_bytes(b_blocks), a.block_bytes):
        assert torch.equal(got, want)
    engine.step_until(lambda s: b.is_finished(), "B finished")
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(b.output_token_ids) == MAX_TOKENS


def test_after_vllm_resets_the_connector_the_same_prompt_misses(engine):
    _run_a(engine)
    _forget_in_engine(engine)
    b = _load_b(engine).request
    engine.step_until(lambda s: b.is_finished(), "B finished")

    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    c = engine.add("C", PROMPT)
    steps = engine.step_until(lambda s: "C" in s.output.num_scheduled_tokens, "C scheduled")
    # C misses: vLLM computes it from scratch, nothing is loaded.
    ran = _scheduled_new(steps[-1], "C")
    assert ran is not None and ran.num_computed_tokens == 0
    assert steps[-1].output.num_scheduled_tokens["C"] == PROMPT_LEN
    assert not any("C" in s.meta.loads for s in steps)
    assert c.status == RequestStatus.RUNNING
    # The reset went to the worker with the next step's metadata, and C's lookup waited
    # until the worker reported it done (no answer from copies being dropped).
    reset_at = [i for i, s in enumerate(steps) if s.meta.reset]
    assert len(reset_at) == 1 and reset_at[0] < len(steps) - 1
