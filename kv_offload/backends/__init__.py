"""Storage tiers behind host memory, chosen by config and imported only when chosen.

The connector config picks the secondary tier with ``storage_tier``: a built-in name below or
``"package.module:ClassName"`` (a ``StorageTier`` subclass), with its settings in
``storage_options``. The old ``fs_root_dir`` / ``fs_bytes_to_use`` / ``fs_fsync`` keys
still open the filesystem tier until 0.2 (`parse_config` warns: one documented spelling).
Each tier checks its own options (``StorageTier.check_options``) at start-up in every
process, before anything connects, so a typo stops the server with a ``ConfigError`` that
names the option and lists the accepted ones.

Contents:
- ``BUILTIN_TIERS``: name -> "module:Class" (and the pip extra a tier needs).
- ``tier_class(name)``: the class, imported lazily; ``ConfigError`` if it cannot be.
- ``storage_choice(config)``: which tier the config asks for, with its options.
- ``tier_label(name)``: the one name a tier goes by in metrics labels, log lines and tool
  output (``disk``, ``valkey``, ``s3``, a plug-in's class name).
- ``check_storage_config(config)``: validate that choice without opening anything.
- ``make_storage_tier(config, fingerprint)``: open it (or None: host memory only). With
  ``secret_file``, built-in tiers get the keyed record codec, and any other tier is wrapped in
  ``SealedTier`` (see common/sealed_tier.py: a plug-in cannot opt out of authentication).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_offload.errors import ConfigError

if TYPE_CHECKING:
    from kv_offload.backends.base import StorageTier
    from kv_offload.backends.record import RecordCodec
    from kv_offload.config import OffloadConfig


@dataclass(frozen=True)
class BuiltinTier:
    path: str  # "module:Class"
    label: str  # its name in metrics labels, log lines and tool output
    extra: str | None = None  # the pip extra that installs its client library


BUILTIN_TIERS: dict[str, BuiltinTier] = {
    # ("disk": the label this tier has had since the first release; dashboards use it)
    "filesystem": BuiltinTier("kv_offload.backends.filesystem:FilesystemTier", "disk"),
    "valkey": BuiltinTier("kv_offload.backends.valkey:ValkeyTier", "valkey", extra="valkey"),
    "s3": BuiltinTier("kv_offload.backends.s3:S3Tier", "s3", extra="s3"),
}


def tier_label(name: str) -> str:
    """The name a storage tier goes by in metrics labels (``tier="valkey"``), log lines and
    tool output: a built-in's label, or a plug-in's class name (``"pkg.mod:MyTier"`` ->
    ``"MyTier"``). Nothing is imported."""
    builtin = BUILTIN_TIERS.get(name)
    return builtin.label if builtin is not None else name.rpartition(":")[2] or name


@dataclass(frozen=True)
class StorageChoice:
    """The secondary tier a config asks for."""

    name: str  # a BUILTIN_TIERS name or "module:Class"
    options: dict[str, Any]

    @property
    def label(self) -> str:
        """Its name in metrics, logs and tool output (``tier_label``)."""
        return tier_label(self.name)


def storage_choice(config: OffloadConfig) -> StorageChoice | None:
    """The tier ``config`` asks for, or None (host memory only)."""
    if config.fs_root_dir is not None:
        return StorageChoice("filesystem", {"root_dir": config.fs_root_dir,
                                            "bytes_to_use": config.fs_bytes_to_use,
                                            "fsync": config.fs_fsync})
    if config.storage_tier is None:
        return None
    return StorageChoice(config.storage_tier, dict(config.storage_options))


def tier_class(name: str) -> type[StorageTier]:
    """The tier class of a built-in name or a "package.module:ClassName" path."""
    from kv_offload.backends.base import StorageTier

    builtin = BUILTIN_TIERS.get(name)
    if builtin is None and ":" not in name:
        raise ConfigError(f"unknown storage_tier {name!r}; expected one of "
                          f"{sorted(BUILTIN_TIERS)} or 'package.module:ClassName'")
    module_name, _, class_name = (builtin.path if builtin else name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = (f"; install it with pip install 'kv-offload[{builtin.extra}]'"
                if builtin and builtin.extra else "")
        raise ConfigError(f"storage_tier {name!r}: cannot import {module_name} ({e}){hint}") \
            from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, StorageTier)):
        raise ConfigError(f"storage_tier {name!r}: {module_name} has no StorageTier subclass "
                          f"named {class_name!r} (got {cls!r})")
    return cls


def check_storage_config(config: OffloadConfig) -> None:
    """Raise ``ConfigError`` if the chosen tier cannot be imported or its options are bad.
    Opens nothing, connects nowhere: safe to call at start-up in every process."""
    choice = storage_choice(config)
    if choice is not None:
        tier_class(choice.name).check_options(choice.options)


def make_storage_tier(config: OffloadConfig, fingerprint: str,
                      codec: RecordCodec | None = None) -> StorageTier | None:
    """Open the secondary tier of ``config`` for one layout ``fingerprint`` (None: none).
    ``codec``: how records are protected (default: the one ``config`` asks for)."""
    from kv_offload.backends.common.sealing import make_codec

    choice = storage_choice(config)
    if choice is None:
        return None
    if codec is None:
        codec = make_codec(config.secret_file, config.encrypt, config.compression)
    cls = tier_class(choice.name)
    if choice.name in BUILTIN_TIERS:  # they write records themselves: given the codec
        return cls.from_options(choice.options, fingerprint, codec=codec)
    if not codec.keyed:
        return cls.from_options(choice.options, fingerprint)
    from kv_offload.backends.common.sealed_tier import SealedTier

    inner = cls.from_options(choice.options, codec.tier_fingerprint(fingerprint))
    return SealedTier(inner, codec, fingerprint)
