"""What the scheduler side planned since the last step, for the workers to carry out.

Lookups, allocations and finished requests add to the plan between two steps; `build_meta`
(or, when that failed, `fallback_meta`) hands the whole plan to the workers in the step's
`KVOffloadMetadata` and starts a new one. A typed record rather than seven loose lists,
so "what goes out with the next step" has one name and one place where it is emptied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_offload.types import GroupBlocks, OffloadKey


@dataclass
class StepPlan:
    """The next step's loads, failures and requests for the workers."""

    loads: dict[str, GroupBlocks] = field(default_factory=dict)  # request -> its blocks
    in_step: list[str] = field(default_factory=list)  # of `loads`: done before the forward
    failed_loads: list[str] = field(default_factory=list)  # reported failed, by request
    failed_blocks: list[int] = field(default_factory=list)  # in-step loads not planned
    protect: list[OffloadKey] = field(default_factory=list)  # keys of hits found
    held: list[str] = field(default_factory=list)  # finished requests held for copies
    find: list[OffloadKey] = field(default_factory=list)  # keys to ask the stores for
    reset: bool = False  # drop the host tier on every rank
