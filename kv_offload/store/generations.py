"""Key generations that outlive the process: a connector reset survives a restart.

A reset (`TieredStore.reset`) starts a new random storage-key generation so that nothing stored
before it is served after it (`kv_offload.store.key_view`). Kept in memory only, a restarted
engine would start again where it began and serve the pre-reset keys. So the generation is
written to the storage tier itself (`StorageTier.write_generation`: a small record in the
tier's layout namespace, where every engine sharing the store looks), and read back at
start-up (`StorageTier.read_generation`).

The record is an ordinary record (`kv_offload.backends.record`) of the generation's 8 bytes
under a fixed key, sealed with the tiers' codec: with `secret_file` only holders of the
secret can set it. (A writer of the store could still put back an older record of the same
secret, a replay: the generation is not a counter. Without a secret, anyone with write
access can set it, as they can set any value.)

The rule: **no record is never a known generation.** A record can go missing with nothing
said: deleted (no secret needed), evicted by a server under memory pressure
(``allkeys-lru``), lost by a server restarted empty. Reading "none" as the first generation
would make every record stored before the last reset servable again (they still verify).
So what start-up does with what it finds:
- a record that verifies: its generation (restarts and other engines share their keys);
- no record: a fresh random generation, created only if still none is there
  (`StorageTier.create_generation`: a conditional write), then whichever record the tier
  holds is used, so engines starting together agree on one. Records stored under any
  earlier generation are never served again (a cold cache; they age out under the tier's
  budget or the server's eviction);
- a record that does not verify: a fresh random generation (a cold cache, never pre-reset
  keys). Logged;
- a store that cannot be read (down at start-up): a fresh random generation for now, and
  the engine keeps asking (`TieredStore.settle_generation`, every few seconds off the step
  path); once the store answers, it adopts the fleet's generation (or, if none is kept,
  stores its own as above), so it is never isolated from the fleet for good. Logged.
A tier that keeps no record (`create_generation` returns None: the base class's default
when `write_generation` does) cannot lose one either: it starts at `FIRST_GENERATION`, and a
reset lasts until the process ends (`TieredStore.reset` warns about it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kv_offload.backends.base import StorageTier
from kv_offload.backends.record import NETWORK_ALIGN, RecordCodec, pack, unpack_into
from kv_offload.store.key_view import FIRST_GENERATION, GENERATION_BYTES, new_generation

logger = logging.getLogger("kv_offload")

GENERATION_KEY = b"kv-offload key generation"


def generation_record(generation: bytes, codec: RecordCodec, fingerprint: str) -> bytes:
    """The stored form of ``generation``."""
    return bytes(pack(GENERATION_KEY, fingerprint, memoryview(generation),
                      align=NETWORK_ALIGN, codec=codec))


@dataclass(frozen=True)
class StoredGeneration:
    """What start-up found: the generation to start in (None: start a fresh one), and
    whether the tier could not be reached (then the engine asks again later and joins the
    fleet's generation once it can: `TieredStore.settle_generation`)."""

    generation: bytes | None
    unreachable: bool = False


def read_stored_generation(tier: StorageTier, codec: RecordCodec, fingerprint: str,
                           fresh: bytes | None = None, *, quiet: bool = False
                           ) -> StoredGeneration:
    """The generation to start in (see the module docstring): the record's if it verifies;
    none there: `fresh` (default: a new one), created unless another starter just did."""
    try:
        record = tier.read_generation()
        if record is None:  # (none: create one, unless another starter just did)
            record = tier.create_generation(generation_record(
                fresh or new_generation(), codec, fingerprint))
            if record is None:  # (a tier that keeps no record: nothing can be lost)
                return StoredGeneration(FIRST_GENERATION)
    except Exception as exc:
        if quiet:  # (asked again during an outage: said once, at start-up)
            return StoredGeneration(None, unreachable=True)
        logger.warning("kv-offload: the storage tier (%s) cannot be reached at start-up "
                       "(%s): this engine runs with host memory only until it answers, then "
                       "joins the key generation the others use (set storage_required to "
                       "stop instead)", tier.describe(), exc)
        return StoredGeneration(None, unreachable=True)
    out = bytearray(GENERATION_BYTES)
    got = unpack_into(record, GENERATION_KEY, fingerprint, memoryview(out),
                      align=NETWORK_ALIGN, codec=codec)
    if not got.ok:
        logger.warning("kv-offload: the storage tier's key generation record does not verify "
                       "(%s); starting a fresh generation", got.bad or "wrong size")
        return StoredGeneration(None)
    return StoredGeneration(bytes(out))


def write_stored_generation(tier: StorageTier, generation: bytes, codec: RecordCodec,
                            fingerprint: str) -> bool:
    """Persist ``generation``; False (logged) if the tier could not keep it."""
    try:
        kept = tier.write_generation(generation_record(generation, codec, fingerprint))
    except Exception as exc:
        logger.warning("kv-offload: writing the key generation failed: %s", exc)
        kept = False
    if not kept:
        logger.warning("kv-offload: the storage tier (%s) did not keep the new key "
                       "generation: after a restart, keys stored before this reset may be "
                       "served again", type(tier).__qualname__)
    return kept
