"""Stores of Mamba-type states (Mamba2, GatedDeltaNet, short-conv): exactly the ones vLLM offers.

Contents: `mamba_groups` (which groups hold recurrent states), `check_mamba_servable`
(the configurations we refuse, by setting), `BoundaryStateStores` (offers -> store plans).

Why offers and not block positions. An attention block at index i always holds tokens
`[i*B, (i+1)*B)`, so the scheduler side can store it by position. A Mamba-type group holds
one state per request, valid for a token count, and in vLLM 0.32's prefix-caching "align"
mode the Mamba manager keeps a snapshot in the block of each retained boundary, but moves,
relocates and nulls those blocks as the request proceeds (speculative and checkpoint blocks,
copy-on-write of partial hits). A block position therefore does not name a state. The
scheduler instead hands a producer-side connector the exact states it may offload:
`scheduler_output.kv_connector_block_state.boundary_state_offloads`, request id ->
`[(group id, block id, tokens)]`, the state of that group in that block being valid for
exactly `tokens` tokens (vLLM's `take_boundary_state_offloads`, drained every step).

What we do with an offer. A state valid at `tokens`, a multiple of the group's block size,
is the state a hit of length `tokens` needs: vLLM's Mamba hit rule loads only the last block
before the hit point, index `tokens / block_size - 1`, and our keys are `(block hash at that
block's end, group)` like every other group, so `find_longest_cache_hit` over all groups
decides a hit with no Mamba-specific code, and a load writes the state into the block vLLM
allocated at that index (the async load path every group uses; a synchronous load would be
overwritten: vLLM copies the hit state into the running block before the forward).
States at other token counts (sub-block partial tails) are skipped: no hit we offer ends
there.

When the bytes are valid. An offer made while scheduling a step names a state that step's
forward writes (or one already written); it stays valid until vLLM reuses the block, which
is no earlier than the next step (align mode writes the next state into the next block, it
does not overwrite an offered one in place). Our stores copy after the forward
(`wait_for_save`); the block is fenced like a sliding-window block (`StoreFence`: a Mamba
group frees blocks of running requests), so a later step that allocates it again, or
copies into it (vLLM's copy-on-write of partial hits), waits for the copy first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kv_offload.errors import ConfigError
from kv_offload.specs import KVCacheGroup, KVCacheSpec, MambaSpec

NULL_BLOCK_ID = 0


def mamba_groups(specs: Iterable[KVCacheSpec]) -> frozenset[int]:
    """Indices of the groups whose blocks hold recurrent states (any `MambaSpec`)."""
    return frozenset(g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec))


def check_mamba_servable(groups: list[KVCacheGroup], vllm_config: Any) -> None:
    """Refuse, by the setting to change, the Mamba configurations we cannot serve exactly.

    - Prefix caching off (vLLM's Mamba cache mode "none"): vLLM hashes no blocks and offers
      no states; the state lives in one block, overwritten in place by every step.
    - Speculative decoding with a Mamba-type group: vLLM keeps extra state blocks per
      request that it relocates every step; untested here, so refused rather than guessed.
    """
    mamba = [g for g, group in enumerate(groups) if isinstance(group.spec, MambaSpec)]
    if not mamba:
        return
    cache = vllm_config.cache_config
    mode = getattr(cache, "mamba_cache_mode", None)
    if not cache.enable_prefix_caching or mode != "align":
        raise ConfigError(
            f"KV-cache group {mamba[0]} (layers {groups[mamba[0]].layer_names[:3]}...) holds "
            f"Mamba-type states and vLLM runs it with enable_prefix_caching="
            f"{cache.enable_prefix_caching}, mamba_cache_mode={mode!r}: kv-offload serves "
            "Mamba-type hybrids only in vLLM's prefix-caching 'align' mode (the states vLLM "
            "offers to connectors): enable prefix caching (--enable-prefix-caching, "
            "enable_prefix_caching=True), which selects that mode")
    speculative = [g for g in mamba if groups[g].spec.num_speculative_blocks]
    if speculative:
        raise ConfigError(
            f"KV-cache group {speculative[0]} holds Mamba-type states with "
            f"num_speculative_blocks={groups[speculative[0]].spec.num_speculative_blocks}: "
            "kv-offload does not serve Mamba-type hybrids with speculative decoding yet; "
            "run without speculative_config")


@dataclass(frozen=True)
class StateOffer:
    """One state vLLM offers: group `group`'s state in block `block_id`, valid for exactly
    `tokens` tokens of request `request_id`."""

    request_id: str
    group: int
    block_id: int
    tokens: int


def offers_of(scheduler_output: Any) -> list[StateOffer]:
    """This step's offers, in vLLM's order (none when vLLM offers none)."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    if block_state is None:
        return []
    return [StateOffer(req_id, group, block_id, tokens)
            for req_id, entries in block_state.boundary_state_offloads.items()
            for group, block_id, tokens in entries]


class BoundaryStateStores:
    """Turns vLLM's state offers into store plans for the Mamba-type groups: per offer,
    one key `(hash of the block ending at the state's token count, group)` and its block."""

    def __init__(self, specs: list[KVCacheSpec], hash_block_size: int) -> None:
        self.groups = mamba_groups(specs)
        self._block_size = {g: specs[g].block_size for g in self.groups}
        self._hash_block_size = hash_block_size

    def plan(self, offers: Iterable[StateOffer], request_of: Callable[[str], Any],
             computed_after_step: Callable[[str], int | None],
             held: Callable[[bytes, int], bool],
             stores: dict[int, tuple[list, list]]) -> list[StateOffer]:
        """Add the offered states worth storing to `stores`; returns those offers.

        `request_of(id)` is vLLM's request (its block hashes) or None when unknown;
        `computed_after_step(id)` the tokens computed once this step's forward ran (None:
        not scheduled, nothing more is computed); `held(hash, group)` whether every rank
        already holds that key. Work is proportional to the offers."""
        added: list[StateOffer] = []
        for offer in offers:
            block_size = self._block_size.get(offer.group)
            if block_size is None or offer.block_id == NULL_BLOCK_ID:
                continue  # not a Mamba-type group of ours, or no state
            if offer.tokens <= 0 or offer.tokens % block_size:
                continue  # a sub-block tail: no hit we offer ends there
            request = request_of(offer.request_id)
            if request is None:
                continue
            computed = computed_after_step(offer.request_id)
            if computed is None:
                computed = request.num_computed_tokens
            if offer.tokens > computed:
                continue  # not written by the time we copy (never expected; be safe)
            index = offer.tokens // self._hash_block_size - 1
            hashes = request.block_hashes
            if index >= len(hashes):
                continue
            block_hash = bytes(hashes[index])
            if held(block_hash, offer.group):
                continue
            hashes_out, ids_out = stores.setdefault(offer.group, ([], []))
            hashes_out.append(block_hash)
            ids_out.append(offer.block_id)
            added.append(offer)
        return added
