"""Records refused on read, logged once per episode.

A record that fails its checks (header, checksum, keyed tag, decryption) is a miss, removed
where the tier can remove it, and counted by the tier as ``rejected_records`` (the engine's
``vllm:kv_offload_storage_rejected_records_total``). A forger, or a bad disk, can produce many
of them: the first of an episode is logged with its reason, the rest only counted, and the
episode's end is logged once reads verify again for a while (``kv_offload.runtime.faults``).
"""

from __future__ import annotations

from kv_offload.runtime.faults import FaultLog

WHERE = "record verification"


class Rejections:
    """The episode log of one tier's refused records. Thread-safe."""

    def __init__(self, owner: str) -> None:
        self._log = FaultLog(owner)

    def rejected(self, key: bytes, reason: str) -> None:
        self._log.failed(WHERE, f"record of key {key.hex()} refused and removed: {reason} "
                                f"(damaged, foreign, or written without the shared secret)")

    def verified(self) -> None:
        """A record passed its checks (cheap unless an episode is open)."""
        self._log.succeeded(WHERE)
