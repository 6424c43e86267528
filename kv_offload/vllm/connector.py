"""KVOffloadConnector: vLLM 0.32's KV-connector interface over kv-offload's tiers.

Load it with
    --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
                           "kv_connector_module_path": "kv_offload.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": "16GiB"}}'

vLLM builds one instance per role: the scheduler's (`OffloadScheduler`: hits, load and
store plans, no tensors) and one per worker rank (`OffloadWorker`: canonicalised caches
and the tiers). This class only routes vLLM's calls to them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kv_offload.backends import storage_choice
from kv_offload.config import parse_config
from kv_offload.errors import ConfigError
from kv_offload.runtime.faults import FaultLog
from kv_offload.store.startup_checks import check_before_engine_start, check_startup
from kv_offload.types import Location
from kv_offload.vllm import startup_error
from kv_offload.vllm import stats as offload_stats
from kv_offload.vllm.fingerprint import fingerprint_extra
from kv_offload.vllm.logs import adopt_vllm_logging
from kv_offload.vllm.metadata import KVOffloadMetadata
from kv_offload.vllm.scheduler.in_step_loads import InStepLoads
from kv_offload.vllm.scheduler.kv_events import kv_events_enabled, make_kv_events
from kv_offload.vllm.scheduler.mamba_states import check_mamba_servable
from kv_offload.vllm.scheduler.offload_scheduler import OffloadScheduler
from kv_offload.vllm.scheduler.store_waits import StoreWaits
from kv_offload.vllm.spec_translation import translate_groups
from kv_offload.vllm.weights import PendingWeights, looks_remote, require_identity
from kv_offload.vllm.worker.offload_worker import OffloadWorker

logger = logging.getLogger(__name__)
# A request vLLM ended because of its own output, after it handled the step's failed loads
# (`update_from_output`): one that ended so in the step of its in-step load had that load
# succeed on every rank (else vLLM would have rewound it). (By name: vLLM adds statuses.)
_ENDED_BY_OUTPUT = {getattr(RequestStatus, name) for name in (
    "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
    if hasattr(RequestStatus, name)}


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads vLLM's KV cache to host memory and disk, and serves prefix hits from them.

    Only configuration errors raise, and only here, at start-up (before the model loads,
    on the scheduler side too). Every other method is contained (`_contained`): a fault
    becomes failed loads (recomputed) or skipped stores, a metrics counter, and one log
    line per episode."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()  # (our INFO lines in the engine's log: logs.py)
        if kv_cache_config is None:
            raise ConfigError("KVOffloadConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        transfer_config = vllm_config.kv_transfer_config
        self.config = parse_config(transfer_config.kv_connector_extra_config)
        _require_recompute_on_failure(transfer_config)
        _refuse_unsupported(vllm_config)
        groups = translate_groups(kv_cache_config)
        check_mamba_servable(groups, vllm_config)
        hash_block_size = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
        self.config.check_engine_block_size(hash_block_size)
        parallel = vllm_config.parallel_config
        world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        check_startup(self.config, groups, local_ranks=world_size)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        self._lookup_stats = offload_stats.KVOffloadStats()
        choice = storage_choice(self.config)
        self._storage_label = choice.label if choice is not None else None
        model = vllm_config.model_config
        if looks_remote(model.model) and self.config.model_identity is None:
            require_identity(None, model.model, choice.name if choice else None)
        if role == KVConnectorRole.SCHEDULER:
            _warn_if_hashes_are_per_process(vllm_config)
            self._scheduler = OffloadScheduler(
                [g.spec for g in groups], hash_block_size, world_size,
                events=make_kv_events(vllm_config, kv_cache_config, hash_block_size,
                                      choice.name if choice else None),
                in_step=InStepLoads([g.spec for g in groups], [
                    g.spec.page_size_bytes * len(g.layer_names) for g in groups],
                    self.config.in_step_load_bytes, read_budget_s=self.config.in_step_read_s,
                    world_size=world_size),
                role=transfer_config.kv_role or "kv_both",
                waits=StoreWaits(self.config.remote_wait_s, storage=choice is not None,
                                 find_on_lookup=self.config.find_on_lookup))
            self._faults = FaultLog("kv-offload scheduler")
        else:
            rank = _worker_rank(parallel)
            self._groups = groups
            self._num_blocks = kv_cache_config.num_blocks
            self._configs = vllm_config, kv_cache_config
            self._storage_tier = choice.name if choice else None
            # (read from now on, while vLLM loads the same files: see vllm/weights.py)
            self._weights = PendingWeights(model.model, model.revision,
                                           self.config.model_identity)
            self._worker = OffloadWorker(
                self.config, rank, "", tp_share=None,
                report_storage_copies=kv_events_enabled(vllm_config),
                engine_pins_threads=current_platform.is_cpu())  # (vLLM's CPU worker pins)
            self._faults = self._worker.faults

    # ---------------- properties ----------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped store is only a future miss

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # Start-up: may raise. The store opens under the weights' identity, known by now
        # (vLLM loaded the weights; nothing was stored or served before this).
        weights = self._weights.result()
        model = self._configs[0].model_config.model
        require_identity(weights, model, self._storage_tier)
        engine = fingerprint_extra(*self._configs, self._groups, self._worker.rank, weights)
        identity = weights.describe() if weights else \
            f"model {model!r} keyed by name (host memory only)"
        self._worker.register(kv_caches, self._groups, self._num_blocks,
                              engine.shape, engine.share, identity=identity)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Runs at the start of every step, before any forward: stores still reading blocks
        # vLLM may reuse in it must be out of engine memory first (the scheduler side says
        # when; unknown: wait).
        def prepare() -> None:
            self._worker.step_started()
            if getattr(kv_connector_metadata, "wait_for_stores", True):
                self._worker.wait_for_engine_copies()
            if getattr(kv_connector_metadata, "wait_for_loads", False):
                self._worker.wait_for_given_up_loads()

        self._contained("handle_preemptions", prepare, self._worker.abandon_stores)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()

        def start() -> None:
            assert isinstance(meta, KVOffloadMetadata), type(meta).__name__
            self._worker.begin_step(meta.step)
            self._worker.hold_for_copies(meta.held)  # (first: these must come back)
            if meta.reset:
                self._worker.reset()
            if meta.protect:
                self._worker.protect(meta.protect)
            if meta.find:
                self._worker.find(meta.find)
            self._worker.start_loads(meta.loads, meta.failed_loads, in_step=meta.in_step,
                                     failed_blocks=meta.failed_blocks)

        def fail_all() -> None:  # whatever was promised must come back, as failed
            loads = getattr(meta, "loads", {})
            self._worker.fail_loads([*loads, *getattr(meta, "failed_loads", ())],
                                    getattr(meta, "in_step", ()), loads,
                                    getattr(meta, "failed_blocks", ()))
            # (after the failures: if this raised first, the in-step blocks vLLM is about
            # to read would go unreported)
            self._worker.hold_for_copies(getattr(meta, "held", ()))

        self._contained("start_load_kv", start, fail_all)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layer-wise in-step loads (worker/layers.py): this layer's bytes are in; if we
        # cannot tell, the step's layer-wise loads are reported failed (recomputed).
        self._contained("wait_for_layer_load", lambda: self._worker.wait_for_layer(layer_name),
                        self._worker.fail_layer_loads)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Layer-wise stores: the forward is done with this layer, copy it out now (a fault
        # only delays the copy: wait_for_save releases every layer)
        meta = self._get_connector_metadata()
        self._contained("save_kv_layer", lambda: self._worker.layer_saved(
            layer_name, meta.stores, meta.step), None)

    def wait_for_save(self) -> None:
        self._contained("wait_for_save", lambda: self._worker.start_stores(
            self._get_connector_metadata().stores), None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Failed loads are reported per request (vLLM cannot map block ids back to
        # requests with several cache groups); they are recomputed from scratch.
        def results() -> KVConnectorTransferResults:
            # (a step without a forward waits briefly for an asynchronous load to land)
            finished, failed = self._worker.finished_loads(
                idle=self.has_connector_metadata() and self._get_connector_metadata().idle)
            if failed:
                logger.warning("kv-offload: %d request(s) will be recomputed: part of their "
                               "KV could not be loaded", len(failed))
            return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

        return self._contained("get_transfer_results", results, KVConnectorTransferResults)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Blocks of this step's in-step loads that did not arrive (only models with one
        # group load in-step); asynchronous loads fail per request (get_transfer_results).
        # If the errors cannot be taken, every block of this step's in-step loads is one,
        # read from the step's metadata too (the worker may have failed to record them).
        recorded = set(self._worker.in_step_blocks)
        return self._contained("get_block_ids_with_load_errors",
                               self._worker.take_block_errors,
                               lambda: recorded | self._get_connector_metadata()
                               .in_step_block_ids(), recorded)

    def build_connector_worker_meta(self) -> Any:
        return self._contained("build_connector_worker_meta", self._worker.report, None)

    def get_kv_connector_stats(self) -> Any:
        if self._worker is not None:
            return self._contained("get_kv_connector_stats", self._worker.take_stats, None)

        def scheduler_stats() -> Any:
            self._lookup_stats.record_faults(scheduler=sum(self._faults.take_counts().values()))
            self._lookup_stats.record_waits(self._scheduler.waits.take_counts())
            if self._lookup_stats.is_empty():
                return None
            stats, self._lookup_stats = self._lookup_stats, offload_stats.KVOffloadStats()
            return stats

        return self._contained("get_kv_connector_stats", scheduler_stats, None)

    # ------------- asked of the class before any engine starts (config checks) -------------
    # Each runs `check_before_engine_start`: every check that needs no model (keys, types,
    # values, the eviction policy, the storage tier's options, fs_root_dir, host memory for
    # one rank), so a bad configuration stops vLLM before it loads the model.

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM 0.32 and 0.33 ask while they build their config in the front-end process on
        # CUDA with CUDA graphs (the default): before any engine process starts.
        check_before_engine_start(extra_config)
        return False  # nothing of ours runs inside the captured forward

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Every platform: the engine core asks while it sizes the cache, after the weights
        # loaded but before any worker opens a tier (vLLM CPU has no earlier hook).
        try:
            check_before_engine_start(
                vllm_config.kv_transfer_config.kv_connector_extra_config)
        except ConfigError as exc:  # (repeated last, after vLLM's own tracebacks)
            startup_error.record(exc)
            raise
        return None  # any layout: the canonicaliser reads them all

    # ---------------- sleep mode (vLLM >= 0.33; 0.32 never calls these) ----------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # (asked while vLLM 0.33 builds its config, only with sleep mode on)
        check_before_engine_start(kv_transfer_config.kv_connector_extra_config)
        return True  # our copies stop touching engine memory across the sleep

    def unregister_kv_caches(self) -> None:
        self._contained("unregister_kv_caches", self._worker.suspend, None)

    def restore_kv_caches(self) -> None:
        self._contained("restore_kv_caches", self._worker.resume, None)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._contained("shutdown", self._worker.shutdown, None)

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        def lookup() -> tuple[int | None, bool]:
            tokens, load_async, found = self._scheduler.num_new_matched_tokens(
                request, num_computed_tokens)
            if found is not None and not tokens:  # a hit is counted once its source is known
                self._lookup_stats.record_lookup(found.query_tokens, 0)
            return tokens, load_async

        return self._contained("get_num_new_matched_tokens", lookup, (0, False))

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """vLLM 0.33: the groups our load restores. Never a bounded-replay group (we never
        store one), so vLLM replays its window and zeroes its blocks; vLLM's default (the
        prefix-cacheable groups) says the same, but this is what our loads write."""
        return self._scheduler.restored_groups

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._contained(
            "update_state_after_alloc",
            lambda: self._scheduler.after_alloc(request, blocks.get_block_ids(),
                                                num_external_tokens),
            lambda: num_external_tokens and self._scheduler.fail_load(
                request.request_id, [i for ids in blocks.get_block_ids() for i in ids]))

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        def sources() -> dict[CacheHitSource, int]:
            if num_external_tokens == 0:
                return {}
            on_host = self._scheduler.source_of(request.request_id) is Location.HOST
            self._lookup_stats.record_lookup(
                request.num_tokens, num_external_tokens,
                offload_stats.HOST if on_host else self._storage_label or "storage")
            return {CacheHitSource.HOST if on_host else CacheHitSource.DISK:
                    num_external_tokens}

        return self._contained("get_external_cache_hit_sources", sources, {})

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        return self._contained("build_connector_meta",
                               lambda: self._scheduler.build_meta(scheduler_output),
                               lambda: self._scheduler.fallback_meta(scheduler_output),
                               KVOffloadMetadata())

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output.invalid_block_ids:  # (in-step loads that failed on some rank)
            self._contained("update_connector_output", lambda: self._scheduler.blocks_failed(
                connector_output.invalid_block_ids), None)
        self._contained("update_connector_output", lambda: self._scheduler.apply_worker_meta(
            connector_output.kv_connector_worker_meta), None)
        self._contained("update_connector_output", lambda: self._scheduler.loads_finished(
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ())), None)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def take_events(self) -> list[Any]:
        # KV events of our tiers (vLLM publishes them after its own; kv_events.py)
        if self._scheduler is None:
            return []
        return self._contained("take_events", self._scheduler.events.take, [])

    def reset_cache(self) -> bool:
        return self._contained("reset_cache", lambda: self._scheduler.reset() or True, False)

    # ---------------- containment ----------------

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # A prefill server's promise to the decode server first (pd_params.py): it reads
        # the request's state, which `request_finished` drops. A fault: no promise (the
        # decode server recomputes), never a wrong one.
        params = self._contained("request_finished", lambda: self._scheduler.transfer_params(
            request), None)
        # If our bookkeeping fails, keep the blocks only while a load may write them.
        return self._contained(
            "request_finished", lambda: (self._scheduler.request_finished(
                request.request_id, ended_by_output=request.status in _ENDED_BY_OUTPUT),
                params),
            lambda: (self._scheduler.fence_next_step() or
                     self._scheduler.is_loading(request.request_id), params), (False, None))

    def _contained(self, where: str, call: Callable[[], Any], fallback: Any,
                   last_resort: Any = None) -> Any:
        """Run one vLLM-facing call; on a fault, count it, log it once per episode, and
        answer with `fallback` (a value, or a callable giving one) instead of raising;
        `last_resort` if the fallback fails too."""
        try:
            result = call()
        except Exception as exc:
            self._faults.failed(where, exc)
            try:
                return fallback() if callable(fallback) else fallback
            except Exception as again:  # the fallback itself failed: answer neutrally
                self._faults.failed(f"{where} fallback", again)
                return last_resort
        self._faults.succeeded(where)
        return result

    # ---------------- stats ----------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return offload_stats.build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return offload_stats.build_prom_metrics(vllm_config, metric_types, labelnames,
                                                per_engine_labelvalues)


def _require_recompute_on_failure(transfer_config: Any) -> None:
    """vLLM's default policy fails a request whose load failed; ours is to recompute it."""
    if transfer_config.kv_load_failure_policy != "recompute":
        logger.warning("kv-offload: setting kv_load_failure_policy='recompute' (was %r): a "
                       "failed or corrupt load is recomputed, never an error",
                       transfer_config.kv_load_failure_policy)
        transfer_config.kv_load_failure_policy = "recompute"


def _worker_rank(parallel: Any) -> int:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_pp_group().rank_in_group * parallel.tensor_parallel_size + \
        get_tensor_model_parallel_rank()


def _refuse_unsupported(vllm_config: Any) -> None:
    """Context parallelism shards tokens across ranks (a logical block spans ranks and is
    not `block_size` tokens of this rank): not modelled yet, refuse rather than misplace."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise ConfigError(f"KVOffloadConnector does not support {name}={size} yet; "
                              "run without context parallelism")


def _warn_if_hashes_are_per_process(vllm_config: Any) -> None:
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if not algo.startswith("sha256") and "PYTHONHASHSEED" not in os.environ:
        logger.warning("kv-offload: prefix_caching_hash_algo=%r seeds its hashes per process "
                       "unless PYTHONHASHSEED is set: the disk tier will not hit across "
                       "restarts", algo)
