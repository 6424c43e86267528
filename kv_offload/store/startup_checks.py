"""Start-up checks of a connector configuration against the model and the machine.

Everything that can be known before the model loads is checked here, on the scheduler side
too, so a bad value is a `ConfigError` that names the key and the fix at start-up, never an
OOM kill, a silently disabled tier or an error on the first request:
- the choices `kv_offload.config` cannot judge from below (`check_config`): the eviction
  policy's name, the storage tier's options (the tier's `check_options`: connects nowhere) and
  the cipher package `secret_file` needs, and that a shared storage tier (one whose class
  sets `StorageTier.shared`: valkey, s3) has `secret_file` or the explicit opt-out
  `trusted_store` (without either, anyone who can write to the store decides what the engines
  serve: secure by default); `parse_config` checks keys, types and values;
- the eviction policy imports and builds;
- the host tiers of the ranks on this machine fit in the memory available now, and each
  holds at least one block;
- the disk tier's `root_dir` is (or can be made) a directory this process can write files in,
  and its `bytes_to_use` holds at least one block file (in either spelling: storage_options,
  or the old `fs_root_dir` / `fs_bytes_to_use`; each error names the key as written).

`check_before_engine_start` runs the part that needs no model, from the connector class's
hooks that vLLM calls before it starts an engine (see `vllm/connector.py`: on CUDA with
CUDA graphs, in the front-end process while vLLM builds its config; on every platform in
the engine core before any worker opens a tier); `check_startup` the rest, per process (the
connector's constructor, in the scheduler and in every worker, before the model loads).
Both start with `check_config`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload.backends import check_storage_config, storage_choice, tier_class
from kv_offload.backends.common.compression import make_compression
from kv_offload.backends.common.sealing import check_crypto_available
from kv_offload.config import OffloadConfig, format_size, parse_config, parse_size
from kv_offload.errors import ConfigError
from kv_offload.specs import KVCacheGroup
from kv_offload.store.policies import POLICIES, make_policy

FILE_HEADER_ALLOWANCE = 8192  # a block file's header, rounded up to O_DIRECT alignment


def available_host_memory() -> int | None:
    """Bytes of memory available to new allocations now (Linux `MemAvailable`), or None
    where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def block_bytes(groups: Sequence[KVCacheGroup]) -> int:
    """Bytes one block of the largest cache group takes in a host slot or a file (every
    layer of the group, padding included: an upper bound of what is stored)."""
    return max((len(g.layer_names) * g.spec.page_size_bytes for g in groups), default=0)


def check_config(config: OffloadConfig) -> None:
    """Raise `ConfigError` for a choice of `config` that the store or the tiers refuse: an
    eviction policy that is neither built in nor a 'package.module:ClassName' path, a
    `secret_file` without the cryptography package, a storage tier that does not import or
    whose options are bad, a shared storage tier with neither `secret_file` nor
    `trusted_store`. Opens nothing, connects nowhere."""
    policy = config.eviction_policy
    if not isinstance(policy, str) or (policy not in POLICIES and ":" not in policy):
        raise ConfigError(f"eviction_policy must be one of {list(POLICIES)} or "
                          f"'package.module:ClassName', got {policy!r}")
    if config.secret_file is not None:
        check_crypto_available()
    make_compression(config.compression)  # (a codec whose library is missing names its extra)
    check_storage_config(config)  # the tier's own options (it imports only the chosen tier)
    _check_shared_store_trust(config)


def _check_shared_store_trust(config: OffloadConfig) -> None:
    """A shared tier needs `secret_file` or `trusted_store`; `trusted_store` needs a shared
    tier (on any other it would claim a trust decision that was never made)."""
    choice = storage_choice(config)
    shared = choice is not None and tier_class(choice.name).shared
    if shared and config.secret_file is None and not config.trusted_store:
        raise ConfigError(
            f"storage_tier {choice.name!r} is a shared store: without secret_file anyone who "
            f"can write to it decides what the engines serve. Set secret_file to a secret "
            f"file every engine shares (create one with: kv-offload secret new PATH), or, "
            f"for a single-tenant store no one else can write to, set "
            f"\"trusted_store\": true")
    if config.trusted_store and not shared:
        tier = "no storage_tier" if choice is None else f"storage_tier {choice.name!r}"
        raise ConfigError(
            f"trusted_store: true, but {tier} is not a shared store (trusted_store only "
            f"lets a shared tier such as 'valkey' or 's3' run without secret_file); remove "
            f"trusted_store")


def check_startup(config: OffloadConfig, groups: Sequence[KVCacheGroup], *,
                  local_ranks: int = 1, available: int | None = None) -> None:
    """Raise `ConfigError` for a configuration this machine and model cannot run.
    `local_ranks`: worker ranks on this machine (each allocates `cpu_bytes_to_use`)."""
    check_config(config)
    make_policy(config.eviction_policy, 1)  # EvictionPolicyError (a ConfigError) names it
    block = block_bytes(groups)
    if block and config.cpu_bytes_to_use < block:
        raise ConfigError(
            f"cpu_bytes_to_use={_size(config.cpu_bytes_to_use)} holds no block: one block "
            f"of this model takes {_size(block)} per rank; set cpu_bytes_to_use to at least "
            f"{_size(block)} (for real use, thousands of blocks)")
    available = available_host_memory() if available is None else available
    wanted = config.cpu_bytes_to_use * local_ranks
    if available is not None and wanted > available:
        raise ConfigError(
            f"cpu_bytes_to_use={_size(config.cpu_bytes_to_use)} x {local_ranks} rank(s) = "
            f"{_size(wanted)} of host memory, but only {_size(available)} are available on "
            f"this machine; lower cpu_bytes_to_use (it is per worker rank)")
    disk = _disk_tier(config)
    if disk is not None:
        _check_writable_dir(disk.root, disk.root_key)
        smallest = block + FILE_HEADER_ALLOWANCE
        if disk.budget is not None and disk.budget < smallest:
            raise ConfigError(
                f"{disk.budget_key}={_size(disk.budget)} cannot hold one block file "
                f"({_size(smallest)} with its header): the disk tier would store nothing; "
                f"raise {disk.budget_key} or remove {disk.root_key}")


def check_before_engine_start(extra: Mapping[str, Any] | None) -> OffloadConfig:
    """Every check of `kv_connector_extra_config` that needs no model: keys, types, values,
    the eviction policy, the storage tier's options, the disk tier's directory, and host
    memory for one rank. vLLM asks the connector class questions before it loads the model;
    answering runs this, so a bad configuration stops vLLM before it starts an engine."""
    config = parse_config(extra)
    check_startup(config, (), local_ranks=1)
    return config


@dataclass(frozen=True)
class _DiskTier:
    root: str
    budget: int | None
    root_key: str  # the keys as the configuration spells them, for the errors
    budget_key: str


def _disk_tier(config: OffloadConfig) -> _DiskTier | None:
    """The disk tier's directory and budget, in whichever spelling the config used."""
    if config.fs_root_dir is not None:
        return _DiskTier(config.fs_root_dir, config.fs_bytes_to_use, "fs_root_dir",
                         "fs_bytes_to_use")
    if config.storage_tier != "filesystem":
        return None
    options = config.storage_options
    root, budget = options.get("root_dir"), options.get("bytes_to_use")
    if not isinstance(root, str | os.PathLike) or not os.fspath(root):
        return None  # (the tier's own option check names it)
    budget_key = "storage_options.bytes_to_use"
    return _DiskTier(os.path.abspath(os.path.expanduser(os.fspath(root))),
                     None if budget is None else parse_size(budget_key, budget),
                     "storage_options.root_dir", budget_key)


def _check_writable_dir(root: str, key: str) -> None:
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"{key}={root!r} exists and is not a directory; expected a "
                          f"directory (or a path where one can be created)")
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".kv-offload-probe."):
            pass
    except OSError as e:
        raise ConfigError(f"{key}={root!r} is not a writable directory: "
                          f"{e.strerror or e}; expected a directory this process can create "
                          f"files in") from e


def _size(num_bytes: int) -> str:
    """A byte count in an error: human units, with the exact count where they round."""
    human = format_size(num_bytes)
    return human if human.endswith(" B") else f"{human} ({num_bytes} bytes)"
