"""Per-type cache-hit rules: for one group, which cached blocks make a prefix hit.

A rule answers two questions for a group with its own block size:
- `longest_hit`: the largest n <= max_blocks such that a hit covering the first
  n blocks is usable by this layer type, given which blocks are cached;
- `blocks_to_load`: for an accepted hit of n blocks, exactly the block indices
  the layer needs back (a sliding window needs only its window, Mamba only the
  last state), so nothing more is read than the engine can use.
Rules are looked up through the registry, so an out-of-tree spec brings its own.
A rule is given a group's `CachedBlocks`: call it with a block index, or ask `run(start,
stop)` for a run of cached blocks at once (the scheduler answers runs in C, so a rule that
scans forward should ask for runs).
A rule may set `downward_closed = True` when every shorter prefix of a hit is
also a hit (full attention); `hits.find_longest_cache_hit` then asks it once.

A group the engine rebuilds itself after a hit (DeepSeek-V4.1's bounded replay, vLLM 0.33:
it recomputes the hit's last window for that group) takes `ReplayedHit`: it accepts every
hit length and loads nothing, so it neither bounds a hit nor is ever stored, as vLLM's own
prefix cache leaves such groups out of its hit lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kv_offload.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

IsCached = Callable[[int], bool]


class CachedBlocks:
    """One group's answers to "is block i cached?", as a rule is given them.

    `cached(i)` asks one block; `cached.run(start, stop)` counts the cached blocks from
    `start` up to the first that is not (at most `stop - start`). This default asks block by
    block; a subclass answers runs in bulk (`hits.BlockPresence` subclasses hand theirs
    through)."""

    def __init__(self, is_cached: IsCached) -> None:
        self._is_cached = is_cached

    def __call__(self, block: int) -> bool:
        return bool(self._is_cached(block))

    def run(self, start: int, stop: int) -> int:
        n = start
        while n < stop and self(n):
            n += 1
        return n - start


class HitRule(Protocol):
    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        """Largest number of leading blocks (<= max_blocks) this layer type accepts."""
        ...

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        """Block indices to load for an accepted hit of `num_blocks` blocks."""
        ...


class FullAttentionHit:
    """Every token is attended: the longest run of cached blocks from block 0."""

    # Every prefix of a hit is a hit: a lookup may trim the answer instead of asking again.
    downward_closed = True

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        return is_cached.run(0, max_blocks)

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(num_blocks)


def window_blocks(spec: SlidingWindowSpec) -> int:
    """Blocks before the hit point that a window of w tokens still reads:
    ceil((w - 1) / block_size), the w - 1 tokens before the next one."""
    return -(-(spec.sliding_window - 1) // spec.block_size)


class SlidingWindowHit:
    """The last `window_blocks` blocks before the hit point must be cached; a
    run of cached blocks starting at block 0 is also a valid (shorter) hit."""

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        needed = window_blocks(spec)
        if needed == 0:
            return max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if not is_cached(i):
                run = 0
                continue
            run += 1
            if run == needed:
                return i + needed
        return run  # the run that reaches block 0 (possibly empty)

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(max(0, num_blocks - window_blocks(spec)), num_blocks)


def chunk_start_block(spec: ChunkedLocalAttentionSpec, num_blocks: int) -> int:
    """First block of the attention chunk that contains token position
    `num_blocks * block_size` (the first token computed after the hit)."""
    chunk = spec.attention_chunk_size
    start_token = (num_blocks * spec.block_size) // chunk * chunk
    return start_token // spec.block_size


class ChunkedLocalHit:
    """Only the blocks of the chunk containing the hit point are read."""

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        n = chunk_start_block(spec, max_blocks)
        return n + is_cached.run(n, max_blocks)

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(chunk_start_block(spec, num_blocks), num_blocks)


class MambaHit:
    """The recurrent state after the last block summarises everything before it."""

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        for i in range(max_blocks - 1, -1, -1):
            if is_cached(i):
                return i + 1
        return 0

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(num_blocks - 1, num_blocks) if num_blocks else range(0)


class NoPrefixHit:
    """Cross attention caches encoder output, which no prompt prefix determines."""

    downward_closed = True

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        return 0

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(0)


class ReplayedHit:
    """The engine recomputes this group's part of a hit (bounded replay): any hit length
    suits it and it loads nothing, so no block of it is ever worth storing either."""

    downward_closed = True

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        return max_blocks

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return range(0)


class SlidingWindowMLAHit:
    """A sliding window over MLA latents hits like any sliding window, unless the engine
    replays it (`bounded_replay`): then it is `ReplayedHit`."""

    def longest_hit(self, spec: KVCacheSpec, is_cached: CachedBlocks, max_blocks: int) -> int:
        return _mla_window_rule(spec).longest_hit(spec, is_cached, max_blocks)

    def blocks_to_load(self, spec: KVCacheSpec, num_blocks: int) -> range:
        return _mla_window_rule(spec).blocks_to_load(spec, num_blocks)


def _mla_window_rule(spec: KVCacheSpec) -> HitRule:
    replayed = isinstance(spec, SlidingWindowMLASpec) and spec.bounded_replay
    return REPLAYED_HIT if replayed else SLIDING_WINDOW_HIT


FULL_ATTENTION_HIT = FullAttentionHit()
SLIDING_WINDOW_HIT = SlidingWindowHit()
CHUNKED_LOCAL_HIT = ChunkedLocalHit()
MAMBA_HIT = MambaHit()
NO_PREFIX_HIT = NoPrefixHit()
REPLAYED_HIT = ReplayedHit()
SLIDING_WINDOW_MLA_HIT = SlidingWindowMLAHit()
