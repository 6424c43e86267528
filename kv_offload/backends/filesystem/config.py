"""Settings and statistics of the filesystem tier."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kv_offload.backends.base import TierStats
from kv_offload.backends.common.options import option
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.errors import ConfigError


@dataclass(frozen=True)
class FilesystemTierConfig:
    """Settings of a filesystem tier.

    Every field but the fingerprint and the codec is an option of ``storage_tier:
    "filesystem"`` (``storage_options``; the old connector keys ``fs_root_dir``,
    ``fs_bytes_to_use`` and ``fs_fsync`` map to ``root_dir``, ``bytes_to_use``, ``fsync``).
    ``layout_fingerprint`` names the page layout of the model: files written under another
    fingerprint are never served. ``bytes_to_use`` bounds every file
    under ``root_dir``, other layout directories included (see ``root_budget``).
    """

    root_dir: str = option("str", doc="the directory of the tier")
    layout_fingerprint: str  # given by the connector, not an option
    bytes_to_use: int = option("size", doc="the disk budget of the whole root, LRU-evicted")
    io_threads: int = option("count", 8, "I/O threads")
    direct_io: bool = option("bool", True, "use O_DIRECT where the filesystem supports it")
    fsync: bool = option("bool", False, "fsync file and directory on every write")
    rescan_interval_s: float = option("seconds", 5.0, "seconds between scans for other "
                                                      "processes' files (0: never)")
    # Timed by how long this tier saw a file unchanged (its monotonic clock), never by the
    # file's mtime against a clock (directory.py, watch.py).
    stale_temp_s: float = option("seconds", 600.0, "sweep temporary files this tier saw "
                                                   "unchanged for this long")
    # A layout directory whose heartbeat (and files) this tier saw unchanged for this long
    # is no live tier's: it may be evicted when the root is over budget. Tiers touch their
    # heartbeat at every rescan and at least every quarter of this. Use one value for all
    # tiers of a root.
    heartbeat_timeout_s: float = option("seconds", 120.0, "a layout directory whose "
                                                          "heartbeat stayed unchanged for "
                                                          "this long is evictable")
    codec: RecordCodec = CHECKSUM  # given by the connector (secret_file), not an option

    def __post_init__(self) -> None:
        if isinstance(self.root_dir, os.PathLike):
            object.__setattr__(self, "root_dir", os.fspath(self.root_dir))
        if not isinstance(self.root_dir, str) or not self.root_dir:
            raise ConfigError(f"root_dir must be a non-empty path, got {self.root_dir!r}")
        if not isinstance(self.layout_fingerprint, str) or not self.layout_fingerprint:
            raise ConfigError(
                f"layout_fingerprint must be a non-empty str, got {self.layout_fingerprint!r}"
            )
        for name in ("bytes_to_use", "io_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if (
            not isinstance(self.heartbeat_timeout_s, (int, float))
            or isinstance(self.heartbeat_timeout_s, bool)
            or self.heartbeat_timeout_s <= 0
        ):
            raise ConfigError(
                f"heartbeat_timeout_s must be a number > 0, got {self.heartbeat_timeout_s!r}"
            )
        for name in ("rescan_interval_s", "stale_temp_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class FilesystemTierStats(TierStats):
    """A snapshot of what the tier holds and what it did since it started."""

    direct_io: bool = False
    foreign_bytes: int = 0  # bytes under the root outside this tier's layout dir (last rescan)
    live_foreign_dirs: int = 0  # other layout dirs with a live tier (last rescan)
    share_bytes: int = 0  # the budget left for this tier's own keys (last rescan)
