"""The nouns every layer shares, defined once.

- `OffloadKey`: `(block hash, KV-cache group)`, the name of one block's bytes in every tier.
- `GroupBlocks`: `{group: (block hashes, engine block ids)}`, pair i is hash i <-> block i:
  what one store or load moves (what the scheduler side plans).
- `Transfers`: `{group: (engine block ids, host slot ids)}`, pair i is block i <-> slot i:
  what one copy between engine memory and the host tier moves (what the copy kernels do).
- `Location`: where a key can be loaded from (host memory, the storage tier, nowhere).
- `KeyChange` / `KeyChanges`: a key whose location changed, and a bounded batch of them
  (what a worker reports so the scheduler can offer hits).
- `Direction`: which way a job moves bytes (store: engine -> tiers; load: tiers -> engine).
- `IdsLike`: block or slot ids as a list, a numpy array or a tensor (the kernels take any).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from kv_offload.transfer import Direction

if TYPE_CHECKING:  # (names only: this module imports neither)
    import numpy as np
    import torch

IdsLike = Union[Sequence[int], "np.ndarray", "torch.Tensor"]  # noqa: UP007 (names, not types)
OffloadKey = tuple[bytes | int, int]
# The media a key is held in, one bit each (0: none): KeyView's codes, a report's byte per key.
HOST_BIT, STORAGE_BIT = 1, 2
GroupBlocks = Mapping[int, tuple[Sequence[bytes | int], Sequence[int]]]
Transfers = Mapping[int, tuple[IdsLike, IdsLike]]


class Location(enum.Enum):
    """Where a key can be loaded from."""

    HOST = "host"  # ready in a host slot
    STORAGE = "storage"  # only in the storage tier: a load reads it into a host slot first
    ABSENT = "absent"


@dataclass(frozen=True)
class KeyChange:
    """`key` can now be loaded from `location` (ABSENT: no longer loadable).
    `in_storage`: the storage tier holds it too (with `location` HOST: a host key written
    through; KV events announce both media)."""

    key: OffloadKey
    location: Location
    in_storage: bool = False


@dataclass(frozen=True)
class KeyChanges:
    """A bounded batch of changes. `reset`: forget every location reported before this
    batch (the tiers were reset); the changes then describe the new state."""

    changes: tuple[KeyChange, ...] = ()
    reset: bool = False


__all__ = ["HOST_BIT", "STORAGE_BIT", "Direction", "GroupBlocks", "KeyChange", "KeyChanges",
           "Location", "OffloadKey", "Transfers"]
