"""The harness of test_vllm_real_scheduler.py and test_vllm_real_scheduler_stalls.py: vLLM's
real Scheduler over a tiny local Llama, and a played model runner that makes each step's
calls on a real worker-role `KVOffloadConnector` (built by its own constructor, over a real
`OffloadWorker`) in the order vLLM's runner makes them (`gpu_model_runner.execute_model` and
`KVConnectorModelRunnerMixin._get_kv_connector_output`: `handle_preemptions` first, in-step
loads before the forward and asynchronous ones after it, `wait_for_layer_load` /
`save_kv_layer` around each layer as `maybe_transfer_kv_layer` does). See the first test
module's docstring."""

# ruff: noqa: E402  (vLLM is imported only once importorskip found it)

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import vllm
from packaging.version import Version
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.config.vllm import set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends import utils as attention_utils
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kv_offload.backends.common.local_process import free_port
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.testing.tiny_models import build_llama
from kv_offload.testing.tiny_vocab import VOCAB_SIZE
from kv_offload.vllm.connector import KVOffloadConnector
from kv_offload.vllm.metadata import KVOffloadMetadata
from kv_offload.vllm.spec_translation import translate_groups

# The only switch between vLLM 0.32 and 0.33 (the Scheduler's constructor, Request, the
# SchedulerOutput fields read here and ModelRunnerOutput are the same in both).
VLLM_033 = Version(vllm.__version__).release >= (0, 33)

BLOCK = 32  # engine block size (vLLM's CPU attention needs a multiple of 32)
LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 32  # build_llama's defaults (hidden 128, 4 heads)
NUM_BLOCKS = 64
PROMPT_LEN = 200  # 6 full blocks and 8 tokens
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK  # whole blocks, never the last token: 192
FULL_BLOCKS = HIT_TOKENS // BLOCK
PROMPT = [4 + (i * 37) % (VOCAB_SIZE - 4) for i in range(PROMPT_LEN)]  # words, no specials
MAX_TOKENS = 3
STEP_DEADLINE_S = 10.0  # loads and stores run on the worker's threads: wait this long at most


def vllm_config_for(model_dir, extra: dict, role: str = "kv_both") -> VllmConfig:
    transfer = KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kv_offload.vllm",
        kv_role=role, kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra)
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=transfer)


@dataclass
class _Planned:
    """What EngineCore._initialize_kv_caches settles before it builds the Scheduler."""

    worker: KVCacheConfig
    scheduler: KVCacheConfig
    block_size: int
    hash_block_size: int


def plan_kv_caches(vllm_config: VllmConfig) -> _Planned:
    """vLLM's KV-cache planning for one CPU worker: the tiny Llama's layers, NUM_BLOCKS."""
    register_all_kvcache_specs(vllm_config)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_num_kv_heads(parallel),
                             head_size=model.get_head_size(), dtype=model.dtype)
    assert (model.get_num_layers(parallel), spec.num_kv_heads, spec.head_size, spec.dtype) == \
        (LAYERS, KV_HEADS, HEAD_SIZE, torch.bfloat16)  # (what the played forward writes)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}]
    memory = [NUM_BLOCKS * LAYERS * spec.page_size_bytes]
    # From the layouts the CPU worker's attention backend supports, onto cache_config:
    supported = attention_utils.get_supported_kv_cache_layouts([CPUAttentionBackend])
    attention_utils.resolve_kv_cache_layout(vllm_config, [[layout.name for layout in supported]],
                                            specs[0].values())
    if VLLM_033:  # vLLM 0.33 moved the planning to kv_cache_planning; it takes the groups
        from vllm.v1.core import kv_cache_planning as planning

        configs = planning.get_kv_cache_configs(
            vllm_config, specs, memory, planning.get_global_kv_cache_groups(vllm_config, specs))
    else:  # vLLM 0.32
        configs = kv_cache_utils.get_kv_cache_configs(vllm_config, specs, memory)
    scheduler_config = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
        scheduler_config, vllm_config)
    alignment = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        scheduler_config, vllm_config, block_size, hash_block_size)
    for config in (*configs, scheduler_config):
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        config.hash_block_size = hash_block_size
        config.cache_hit_alignment_tokens = alignment
    return _Planned(configs[0], scheduler_config, block_size, hash_block_size)


def _slot_bytes(layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the played forward writes for these tokens: [H, len(tokens), K|V] in bfloat16,
    small integers (exact in bfloat16) mixing layer, head, token id, position and lane."""
    lanes, heads = torch.arange(2 * HEAD_SIZE), torch.arange(KV_HEADS)
    mixed = (layer * 101 + heads[:, None, None] * 31 + tokens[None, :, None] * 7
             + positions[None, :, None] * 13 + lanes[None, None, :])
    return (mixed % 251 - 125).to(torch.bfloat16)


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]  # the single full-attention group's block table
    num_computed: int


@dataclass
class Step:
    """One engine step: vLLM's plan, our metadata, loads finished, requests' states after."""

    output: SchedulerOutput
    meta: KVOffloadMetadata
    finished_recving: set[str]
    states: dict[str, tuple[RequestStatus, int]]


def one_process_parallel_groups(vllm_config: VllmConfig) -> None:
    """vLLM's parallel groups for a world of one process (gloo), as a CPU worker sets them
    up before it builds its connector (the connector asks them for its rank). Once per
    process: vLLM's groups are process-wide."""
    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        parallel_state.ensure_model_parallel_initialized(1, 1)


class PlayedModelRunner:
    """vLLM's model runner, minus the model, over a real worker-role `KVOffloadConnector`:
    every connector call vLLM's runner makes in a step, in its order (see the module
    docstring). `worker` is the connector's own `OffloadWorker`."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        one_process_parallel_groups(vllm_config)
        self.connector = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER,
                                            kv_cache_config)
        self.worker = self.connector._worker
        groups, num_blocks = translate_groups(kv_cache_config), kv_cache_config.num_blocks
        self.buffer, self.caches = allocate_kv_caches(
            groups, num_blocks, layout=kv_cache_config.kv_cache_layout)
        self.connector.register_kv_caches(self.caches)
        self.requests: dict[str, _RunnerRequest] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector, meta = self.connector, scheduler_output.kv_connector_metadata
        assert isinstance(meta, KVOffloadMetadata), type(meta).__name__
        connector.handle_preemptions(meta)  # before anything of the step
        self._update_states(scheduler_output)
        connector.bind_connector_metadata(meta)
        # start_load_kv: before the forward when the step has in-step loads, else after it
        if scheduler_output.has_sync_kv_loads:
            connector.start_load_kv(None)
        sampled = self._forward(scheduler_output)
        if not scheduler_output.has_sync_kv_loads:
            connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.clear_connector_metadata()
        if not scheduler_output.total_num_scheduled_tokens:  # (kv_connector_no_forward)
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], kv_connector_output=kv_output)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """The runner's token ids and block tables (vLLM sends only what changed)."""
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
            for cache in self.caches.values():
                cache[block_id].zero_()

    def _forward(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Write each scheduled token's slot, layer by layer between the connector's layer
        hooks; sample a fixed word where the tokens end."""
        if not scheduler_output.total_num_scheduled_tokens:
            return {}
        slots = []  # (blocks, offsets, tokens, positions) of each scheduled request
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed, state.num_computed + num_tokens
            positions = torch.arange(start, end)
            blocks = torch.tensor([state.block_ids[p // BLOCK] for p in range(start, end)])
            slots.append((blocks, positions % BLOCK,
                          torch.tensor(state.token_ids[start:end]), positions))
        for layer, (name, cache) in enumerate(self.caches.items()):
            self.connector.wait_for_layer_load(name)  # (maybe_transfer_kv_layer, on entry)
            for blocks, offsets, tokens, positions in slots:
                # [B, H, N, C]: each token's slot is (its block, every head, its offset)
                cache[blocks, :, offsets] = _slot_bytes(layer, tokens, positions).permute(1, 0, 2)
            self.connector.save_kv_layer(name, cache, None)  # (and on exit)
        sampled = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            sampled[req_id] = []
            if state.num_computed + num_tokens >= len(state.token_ids):  # only max_tokens
                state.token_ids.append(4 + (len(state.token_ids) * 17) % (VOCAB_SIZE - 4))
                sampled[req_id] = state.token_ids[-1:]
        return sampled

    def slots_written(self, output: SchedulerOutput, block_id: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(what the block holds, what the forward of `output` wrote there) for each slot of
        `block_id` that forward wrote, every layer; call it before the next step."""
        pairs = []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            for p in range(state.num_computed, state.num_computed + num_tokens):
                if state.block_ids[p // BLOCK] != block_id:
                    continue
                token, position = torch.tensor([state.token_ids[p]]), torch.tensor([p])
                pairs += [(cache[block_id, :, p % BLOCK], _slot_bytes(layer, token, position)[:, 0])
                          for layer, cache in enumerate(self.caches.values())]
        return pairs

    def block_bytes(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every layer's pages of these blocks, copied."""
        return [cache[block_ids].clone() for cache in self.caches.values()]


def expected_bytes(token_ids: list[int], num_blocks: int) -> list[torch.Tensor]:
    """What the forward writes into the first `num_blocks` blocks of these tokens."""
    n = num_blocks * BLOCK
    tokens, positions = torch.tensor(token_ids[:n]), torch.arange(n)
    return [_slot_bytes(layer, tokens, positions)  # [H, n, C] -> [blocks, H, BLOCK, C]
            .reshape(KV_HEADS, num_blocks, BLOCK, -1).permute(1, 0, 2, 3)
            for layer in range(LAYERS)]


class Engine:
    """EngineCore.step's loop over the real Scheduler and the played runner."""

    def __init__(self, vllm_config: VllmConfig, planned: _Planned) -> None:
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=planned.scheduler,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=planned.block_size, hash_block_size=planned.hash_block_size,
            log_stats=True)
        self.runner = PlayedModelRunner(vllm_config, planned.worker)
        self.transfer_params: dict[str, dict] = {}  # what finished requests' outputs carried
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        # vLLM 0.33's EngineCore also passes its hash look-ahead (0 here); 0.32 has none.
        lookahead = (vllm_config.num_hash_lookahead_tokens,) if VLLM_033 else ()
        self.block_hasher = kv_cache_utils.get_request_block_hasher(
            planned.hash_block_size, hash_fn, *lookahead)

    def add(self, req_id: str, max_tokens: int = MAX_TOKENS,
            prompt: list[int] = PROMPT, kv_transfer_params: dict | None = None) -> Request:
        extra = None if kv_transfer_params is None else \
            {"kv_transfer_params": kv_transfer_params}  # (as vLLM's API server passes them)
        request = Request(req_id, list(prompt),
                          SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                          block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Step:
        output = self.scheduler.schedule()
        runner_output = self.execute(output)
        kv_output = runner_output.kv_connector_output
        return Step(output, output.kv_connector_metadata,
                     set(kv_output.finished_recving or ()) if kv_output else set(),
                     {r: (q.status, q.num_computed_tokens)
                      for r, q in self.scheduler.requests.items()})

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run vLLM's plan on the played runner and hand vLLM the result. A token vLLM
        discards (a request rescheduled after a failed in-step load) leaves the runner's
        copy of the request too, as vLLM's own input batch follows the scheduler."""
        runner_output = self.runner.execute(output)
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            self.transfer_params.update({out.request_id: out.kv_transfer_params
                                         for out in outputs.outputs
                                         if out.kv_transfer_params is not None})
        for req_id, state in self.runner.requests.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                del state.token_ids[request.num_tokens:]
        return runner_output

    def step_until(self, done: Callable[[Step], bool], what: str) -> list[Step]:
        """Step until `done(last step)`; the worker's copies get up to STEP_DEADLINE_S."""
        steps, deadline = [], time.monotonic() + STEP_DEADLINE_S
        while not steps or not done(steps[-1]):
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {len(steps)} steps")
            steps.append(self.step())
            if not steps[-1].output.total_num_scheduled_tokens:
                time.sleep(0.001)  # the worker's threads copy meanwhile
        return steps

    def run_to_completion(self, req_id: str, prompt: list[int] = PROMPT
                          ) -> tuple[Request, list[Step]]:
        request = self.add(req_id, prompt=prompt)
        return request, self.step_until(lambda s: request.is_finished(), f"{req_id} finished")


def scheduled_new(step: Step, req_id: str):  # vLLM's NewRequestData, or None
    return next((new for new in step.output.scheduled_new_reqs if new.req_id == req_id), None)


def stored(steps: list[Step]) -> list[tuple[bytes, int]]:  # (hash, id) of each store
    return [pair for step in steps for hashes, ids in step.meta.stores.values()
            for pair in zip(hashes, ids)]


def forget_in_engine(engine: Engine) -> None:
    """vLLM forgets its own copy; empty steps carry the worker's reports to the scheduler;
    every block is overwritten, so only a load can bring A's bytes back."""
    assert engine.scheduler.reset_prefix_cache()
    empty = [engine.step() for _ in range(3)]
    # A store copies its blocks out during the next forward; vLLM reuses a freed block only
    # in a step whose forward first waits for those copies (`wait_for_stores`), as a step
    # without a forward does: only after one may the test overwrite blocks behind vLLM.
    assert all(step.output.total_num_scheduled_tokens == 0 and step.meta.wait_for_stores
               for step in empty)
    engine.runner.buffer.fill_(0x55)


# ---- fixtures (the test modules import them) ----

ASYNC_ONLY = {"cpu_bytes_to_use": 8 << 20, "in_step_load_bytes": 0}
IN_STEP = {"cpu_bytes_to_use": 8 << 20}  # (the default budget: host hits load in-step)


@pytest.fixture(scope="module", name="llama_dir")  # (named: imported under other names)
def llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("real_scheduler") / "llama")


def make_engine(model_dir, extra: dict, role: str = "kv_both") -> Engine:
    config = vllm_config_for(model_dir, extra, role)
    return Engine(config, plan_kv_caches(config))


@pytest.fixture(name="engines")
def engines(llama_dir):
    """`start(extra_config)` -> an Engine; every engine started is shut down after the test."""
    started: list[Engine] = []

    def start(extra: dict, role: str = "kv_both") -> Engine:
        started.append(make_engine(llama_dir, extra, role))
        return started[-1]

    yield start
    for engine in started:
        engine.runner.worker.shutdown()


@pytest.fixture(name="in_step_engine")
def in_step_engine(engines):
    return engines(IN_STEP)
