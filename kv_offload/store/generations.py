"""Key generations that outlive the process: a connector reset survives a restart.

A reset (`TieredStore.reset`) starts a new random storage-key generation so that nothing stored
before it is served after it (`kv_offload.store.key_view`). Kept in memory only, a restarted engine
would start again at `FIRST_GENERATION` and serve the pre-reset keys. So the generation is
also written to the storage tier itself (`StorageTier.write_generation`: a small record in the
tier's layout namespace, where every engine sharing the store looks), and read back at
start-up (`StorageTier.read_generation`).

The record is an ordinary record (`kv_offload.backends.record`) of the generation's 8 bytes
under a fixed key, sealed with the tiers' codec: with `secret_file` only holders of the
secret can set it. (A writer of the store could still put back an older record of the same
secret, a replay: the generation is not a counter. Without a secret, anyone with write
access can set it, as they can set any value.)

What start-up does with what it finds:
- no record: `FIRST_GENERATION` (every engine starts there: restarts share their keys);
- a record that verifies: its generation;
- a record that does not verify, or a store that cannot be read (raises): a fresh random
  generation (a cold cache, never pre-reset keys), written back when the record was bad so
  the fleet converges on it. Logged.
A tier that keeps no record (the base class's default) makes a reset last until the process
ends; `TieredStore.reset` warns about it.
"""

from __future__ import annotations

import logging

from kv_offload.backends.base import StorageTier
from kv_offload.backends.record import NETWORK_ALIGN, RecordCodec, pack, unpack_into
from kv_offload.store.key_view import FIRST_GENERATION, GENERATION_BYTES

logger = logging.getLogger("kv_offload")

GENERATION_KEY = b"kv-offload key generation"


def generation_record(generation: bytes, codec: RecordCodec, fingerprint: str) -> bytes:
    """The stored form of ``generation``."""
    return bytes(pack(GENERATION_KEY, fingerprint, memoryview(generation),
                      align=NETWORK_ALIGN, codec=codec))


def read_stored_generation(tier: StorageTier, codec: RecordCodec,
                           fingerprint: str) -> bytes | None:
    """The generation the tier holds: FIRST_GENERATION if none was ever written; None when
    the tier cannot be read or holds a record that does not verify (the caller starts a
    fresh generation)."""
    try:
        record = tier.read_generation()
    except Exception as exc:
        logger.warning("kv-offload: could not read the key generation from the storage tier "
                       "(%s); starting a fresh one (a cold cache, never keys from before a "
                       "reset)", exc)
        return None
    if record is None:
        return FIRST_GENERATION
    out = bytearray(GENERATION_BYTES)
    got = unpack_into(record, GENERATION_KEY, fingerprint, memoryview(out),
                      align=NETWORK_ALIGN, codec=codec)
    if not got.ok:
        logger.warning("kv-offload: the storage tier's key generation record does not verify "
                       "(%s); starting a fresh generation", got.bad or "wrong size")
        return None
    return bytes(out)


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
