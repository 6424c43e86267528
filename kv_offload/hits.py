"""Cache hits over N KV-cache groups, and which blocks are worth storing.

Each group has its own spec and block size; its hit rule (from the registry, so
an out-of-tree spec brings its own) says which hit lengths it accepts given
which of its blocks are cached. `find_longest_cache_hit` finds the longest
length L that every group accepts, and for each group exactly the blocks it
must load at L.

Why the fixed point is the maximum (not just *a* common hit). Write A_g for the
lengths group g accepts and lcm for the lcm of the block sizes. A group's
acceptance set need not be downward closed (a sliding window accepts L when the
window before L is cached, yet may reject a shorter L' whose window is not).
The search keeps a candidate C, starting at max_length rounded down to lcm,
and lowers it to each group's answer max(A_g ∩ [0, C]), rounded down to lcm,
until every group answers C itself. If L* is the largest common, lcm-aligned
accepted length, then C >= L* holds throughout: L* is in A_g ∩ [0, C], so the
answer is >= L*, and rounding down to lcm keeps it >= L*. At the end C is
accepted by all, so C = L*. The argument needs each rule's `longest_hit` to be
*exact* (the largest accepted length under the bound, not merely an accepted
one); the built-in rules are. A rule that only returns some accepted length
still yields a valid hit, possibly shorter. vLLM's coordinator uses the same
iteration (it aligns inside each group; we round between groups: same result).

Cost. `is_cached` dominates. A rule that declares `downward_closed = True`
(full attention: every prefix of a hit is a hit) is asked once and trimmed
afterwards, as vLLM does for full attention; other groups are asked again only
when the candidate drops below their last answer, and their `is_cached` answers
are memoised so a block is never queried twice. Groups are asked in that order
(downward-closed first), so a short full-attention prefix bounds the scans of
the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from math import lcm

from kv_offload.errors import HitLookupError, SpecError
from kv_offload.hit_rules import CachedBlocks, HitRule
from kv_offload.registry import KVCacheSpecRegistry, default_registry
from kv_offload.specs import KVCacheSpec, UniformTypeKVCacheSpecs

IsCached = Callable[[int, int], bool]


class BlockPresence:
    """Which blocks are cached, in every group: `is_cached(group, block)`.
    `find_longest_cache_hit` takes one of these or a plain function (which it wraps in
    this class). `run(group, start, stop)` counts the cached blocks of `group` from `start`
    up to the first that is not; this default asks block by block, and a subclass that
    holds its answers in bulk overrides it (`vllm.rank_keys.HeldBlocks`: a full-attention
    hit of n blocks then costs a few C calls, not n Python calls)."""

    def __init__(self, is_cached: IsCached) -> None:
        self._is_cached = is_cached

    def __call__(self, group: int, block: int) -> bool:
        return self._is_cached(group, block)

    def run(self, group: int, start: int, stop: int) -> int:
        n = start
        while n < stop and self(group, n):
            n += 1
        return n - start


@dataclass(frozen=True)
class CacheHit:
    """`num_tokens` tokens can be skipped; group g loads its blocks `blocks[g]`
    (indices in group g's own block size; a window or one state, not a prefix,
    for sliding-window and Mamba groups)."""

    num_tokens: int
    blocks: list[list[int]]


def find_longest_cache_hit(
    specs: Sequence[KVCacheSpec],
    is_cached: IsCached | BlockPresence,
    max_length: int,
    *,
    registry: KVCacheSpecRegistry | None = None,
) -> CacheHit:
    """The longest hit <= `max_length` tokens that every group accepts.

    `is_cached(g, i)` says whether block i of group g (in group g's block size)
    is available. The result is a multiple of every group's block size. The
    caller bounds `max_length` (vLLM: at most the prompt length - 1, so that
    one token is always computed)."""
    if not specs:
        raise SpecError("find_longest_cache_hit needs at least one KV-cache group spec")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 0:
        raise HitLookupError(f"max_length must be an int >= 0, got {max_length!r}")
    presence = is_cached if isinstance(is_cached, BlockPresence) else BlockPresence(is_cached)
    groups = [_GroupLookup(g, spec, presence, registry or default_registry)
              for g, spec in enumerate(specs)]
    align = lcm(*(group.block_size for group in groups))
    candidate = max_length // align * align
    # Downward-closed rules first: one scan each, and they bound the others.
    order = sorted(groups, key=lambda group: not group.downward_closed)
    settled = False
    while not settled:
        settled = True
        for group in order:
            answer = group.answer(candidate)
            if answer != candidate:
                candidate = answer // align * align
                settled = False
    blocks = [list(group.rule.blocks_to_load(group.spec, candidate // group.block_size))
              for group in groups]
    return CacheHit(candidate, blocks)


class _GroupLookup:
    """One group's view during a lookup: its rule and its last answer (tokens)."""

    def __init__(self, index: int, spec: KVCacheSpec, presence: BlockPresence,
                 registry: KVCacheSpecRegistry) -> None:
        self.index = index
        self.spec = _rule_spec(spec)
        self.block_size = spec.block_size
        self.rule: HitRule = registry.rules_for(self.spec).hit_rule
        self.downward_closed = bool(getattr(self.rule, "downward_closed", False))
        # A downward-closed rule is asked at most once, so it needs no memo.
        self.is_cached = _GroupBlocks(presence, index) if self.downward_closed else \
            _MemoisedBlocks(partial(presence, index))
        self.last: int | None = None

    def answer(self, candidate: int) -> int:
        """Largest accepted length <= candidate (tokens), asking the rule only
        when the last answer does not settle it."""
        if self.last is not None and (self.last == candidate or (
                self.last > candidate and self.downward_closed)):
            self.last = candidate
            return candidate
        max_blocks = candidate // self.block_size
        blocks = self.rule.longest_hit(self.spec, self.is_cached, max_blocks)
        if not isinstance(blocks, int) or not 0 <= blocks <= max_blocks:
            raise HitLookupError(
                f"hit rule {type(self.rule).__name__} of group {self.index} "
                f"({type(self.spec).__name__}) returned {blocks!r}; expected an int in "
                f"[0, {max_blocks}]"
            )
        self.last = blocks * self.block_size
        return self.last


class _GroupBlocks(CachedBlocks):
    """One group's view of a `BlockPresence`, its runs answered by the presence itself."""

    def __init__(self, presence: BlockPresence, group: int) -> None:
        super().__init__(partial(presence, group))
        self._presence, self._group = presence, group

    def run(self, start: int, stop: int) -> int:
        return self._presence.run(self._group, start, stop)


class _MemoisedBlocks(CachedBlocks):
    """Answers remembered: a rule asked again (after the candidate dropped) never queries a
    block twice."""

    def __init__(self, is_cached: Callable[[int], bool]) -> None:
        super().__init__(is_cached)
        self._seen: dict[int, bool] = {}

    def __call__(self, block: int) -> bool:
        hit = self._seen.get(block)
        if hit is None:
            hit = self._seen[block] = bool(self._is_cached(block))
        return hit


def _rule_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec whose rule decides hits: a uniform-type group follows its layers,
    which share one type and one window (the registry's uniform key)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def blocks_worth_storing(
    spec: KVCacheSpec,
    num_blocks: int,
    *,
    alignment_tokens: int | None = None,
    registry: KVCacheSpecRegistry | None = None,
) -> list[int]:
    """Indices among a request's first `num_blocks` blocks (of this group) that
    some future hit could load, in increasing order.

    A hit can only end on a multiple of `alignment_tokens` (the lcm of all
    groups' block sizes, as `find_longest_cache_hit` returns; default: this
    group's block size). The result is the union, over those hit points n
    <= num_blocks, of the blocks the rule loads at n: everything for full
    attention, nothing for cross attention, the windows that end on a hit point
    for sliding window (blocks far from every hit point are dropped), the last
    block before each hit point for Mamba. The caller still skips blocks the
    engine has already freed (vLLM nulls sliding-window blocks outside the
    window and Mamba blocks without a state), whose bytes are gone.
    A growing request should use `StoreFrontier`, which returns only what is new."""
    return sorted(StoreFrontier(spec, alignment_tokens=alignment_tokens,
                                registry=registry).advance(num_blocks))


class StoreFrontier:
    """`blocks_worth_storing` for one group of one growing request, incrementally:
    `advance(n)` returns the blocks that became worth storing since the last call (each
    block once, in increasing order). Work over the request's life is linear in its
    blocks, and the rule is asked a few times per call, not once per hit point, when the
    windows of the hit points reached chain back to the frontier.

    Blocks below `frontier` are all decided; decided blocks above it are remembered
    until the frontier passes them.

    Why the chain is exact: a hit of n blocks loads only blocks below n, so every block
    any hit point up to `last` loads is below `last`. If the windows of a chain of hit
    points (`last`, then the nearest hit point at or above the start of its window, and
    so on) cover every block from the frontier up to `last`, the blocks newly worth
    storing are exactly the undecided ones in that range: the other hit points reached
    add nothing outside it. Full attention chains in one call (its window is the whole
    prefix), a sliding window in one call per window length. Otherwise (gaps between
    windows, a rule that returns something other than a range ending at the hit point)
    every hit point reached is asked, as before."""

    def __init__(self, spec: KVCacheSpec, *, alignment_tokens: int | None = None,
                 registry: KVCacheSpecRegistry | None = None) -> None:
        block_size = spec.block_size
        align = block_size if alignment_tokens is None else alignment_tokens
        if not isinstance(align, int) or align <= 0 or align % block_size:
            raise HitLookupError(
                f"alignment_tokens must be a positive multiple of the block size "
                f"{block_size}, got {alignment_tokens!r}"
            )
        self._spec = _rule_spec(spec)
        self._rule = (registry or default_registry).rules_for(self._spec).hit_rule
        self._step = align // block_size
        self._next_hit_point = self._step  # in blocks
        self.frontier = 0
        self._decided: set[int] = set()  # decided blocks at or above the frontier

    @property
    def next_hit_point(self) -> int:
        """Full blocks the request must reach before `advance` can return anything."""
        return self._next_hit_point

    def advance(self, num_blocks: int) -> list[int]:
        """Blocks newly worth storing now that the request has `num_blocks` full blocks."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise HitLookupError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        last = num_blocks // self._step * self._step  # the last hit point reached
        if last < self._next_hit_point:
            return []
        new: list[int] = []
        if self._chain_covers_frontier(last):
            self._decide_up_to(last, new)
        else:
            for hit_point in range(self._next_hit_point, last + 1, self._step):
                self._decide(self._rule.blocks_to_load(self._spec, hit_point), new)
        self._next_hit_point = last + self._step
        new.sort()  # (already sorted unless a rule returned its blocks out of order)
        return new

    def _chain_covers_frontier(self, last: int) -> bool:
        """Whether a chain of hit point windows, from `last` back, covers every block from
        the frontier up to `last` (see the class docstring)."""
        hit_point, covered_from = last, last
        while covered_from > self.frontier:
            blocks = self._rule.blocks_to_load(self._spec, hit_point)
            if not (isinstance(blocks, range) and blocks.step == 1 and
                    blocks.stop == hit_point and blocks.start < covered_from):
                return False  # not a window ending at its hit point, or no progress
            covered_from = blocks.start
            hit_point = -(-covered_from // self._step) * self._step  # at or above the start
        return True

    def _decide(self, blocks, new: list[int]) -> None:
        """Decide the blocks one hit point loads."""
        if isinstance(blocks, range) and blocks.step == 1 and blocks.start <= self.frontier:
            self._decide_up_to(blocks.stop, new)
            return
        decided = self._decided
        for block in blocks:  # an out-of-tree rule may skip blocks
            if block >= self.frontier and block not in decided:
                decided.add(block)
                new.append(block)
        self._move_frontier()

    def _decide_up_to(self, stop: int, new: list[int]) -> None:
        """Decide every block from the frontier up to `stop` (exclusive)."""
        frontier, decided = self.frontier, self._decided
        if stop > frontier:
            if decided:
                new.extend(block for block in range(frontier, stop) if block not in decided)
                self._decided = {block for block in decided if block >= stop}
            else:
                new.extend(range(frontier, stop))
            self.frontier = stop
        self._move_frontier()

    def _move_frontier(self) -> None:
        decided = self._decided
        while self.frontier in decided:
            decided.discard(self.frontier)
            self.frontier += 1
