"""Typed configuration, parsed from vLLM's `kv_connector_extra_config` (a JSON dict).

Every key is declared once below with its type, default and meaning; an unknown
key, a wrong type or an impossible value raises `ConfigError` naming the key and
what is accepted. Byte sizes take an int or a string with a unit ("16GiB",
"500MB", "1.5 TiB").

What only the layers above can judge is checked by `check_config` in
`kv_offload/store/startup_checks.py`: the eviction policy's name (the store's policies), the
storage tier's options (the tier's own `check_options`) and the cipher that `secret_file`
needs. This module sits below the store and the tiers and imports neither; every process runs
that check at start-up, before the model loads, with the same `ConfigError`s.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kv_offload.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# compression: 'off', 'lossless' (the project's codec) and the codecs by name
# (kv_offload.backends.common.compression.CHOICES: the same list, checked by a test)
COMPRESSION_CHOICES = ("off", "lossless", "blosc2-lz4", "blosc2-zstd")
BUILTIN_STORAGE_TIERS = ("filesystem", "valkey", "s3")
# The disk tier's old keys -> its storage_options (one documented spelling: the options).
OLD_DISK_KEYS = {"fs_root_dir": "root_dir", "fs_bytes_to_use": "bytes_to_use",
                 "fs_fsync": "fsync"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class OffloadConfig:
    """What the connector and the tiers are configured with."""

    cpu_bytes_to_use: int
    """Bytes of host memory for the CPU tier (required: the primary tier)."""
    fs_root_dir: str | None = None
    """The old spelling of storage_tier 'filesystem' with storage_options root_dir (read until
    0.2, with a FutureWarning): the directory of the disk tier."""
    fs_bytes_to_use: int | None = None
    """The old spelling of storage_options bytes_to_use (with fs_root_dir): the disk budget."""
    block_size: int | None = None
    """Tokens per offloaded block: unset, or the engine block size (no other value is served)."""
    eviction_policy: str = "slru"
    """Host tier eviction: 'slru' (segmented LRU: keys that served a hit outlive keys stored
    once), 'lru', 'arc', or 'package.module:ClassName' for a custom policy."""
    fs_fsync: bool = False
    """The old spelling of storage_options fsync (with fs_root_dir): fsync files and their
    directory after each write."""
    storage_tier: str | None = None
    """The secondary tier: 'filesystem' (the disk tier), 'valkey', 's3' or
    'package.module:ClassName' (see kv_offload.backends); None: host memory only."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Settings of storage_tier, checked by that tier at start-up (unknown options are
    refused)."""
    secret_file: str | None = None
    """A file (mode 0600) holding the secret shared by the engines that share the storage
    tier: with it, only records tagged with that secret are served
    (kv_offload.backends.common.sealing). Only the path is kept here: the secret is read where
    keys are derived, never logged."""
    encrypt: bool = False
    """Encrypt stored records with AES-GCM under a key derived from secret_file."""
    compression: str = "off"
    """Compress records on the storage tier ('off', 'lossless', or a codec of
    COMPRESSION_CHOICES; kv_offload.backends.common.compression). The host tier never
    compresses; records of both kinds are read whatever the setting. Off by default:
    measured, it saves 28% of the bytes at about 1.1 GB/s per core, no faster than a local
    disk, and record sizes reveal compressibility to readers of a shared store
    (docs/security.md)."""
    trusted_store: bool = False
    """Run a shared storage tier (valkey, s3, or a plug-in whose class sets `shared = True`)
    without secret_file: every writer of the store decides what the engines serve. Only for a
    single-tenant store no one else can write to; otherwise such a tier is refused at
    start-up (`startup_checks.check_config`), and secret_file is the fix."""
    in_step_load_bytes: int = 256 * 2**20
    """A hit whose bytes are all in host memory on every rank, at most this many per rank, is
    loaded inside the step that schedules its request (its prefill runs in that step); a
    larger hit waits in an asynchronous load. 0: always asynchronous."""
    in_step_read_s: float = 0.05
    """A hit (within in_step_load_bytes) that reads blocks from the storage tier also loads
    inside the step when that read is expected to take at most this long: its storage bytes
    per rank over the slowest rank's measured read throughput (the fastest of its last 8
    reads: `kv_offload.store.read_rate`; a probe read measures a storage tier that holds keys at
    start-up: `kv_offload.store.probe`). Unmeasured (no read yet) or slower: asynchronous,
    so a large read never stalls the batch. 0: storage reads always asynchronous (and no
    probe read)."""
    copy_timeout_s: float = 30.0
    """The longest the engine waits for one copy between engine memory and host memory (a
    copy thread the OS does not run): past it an in-step load's blocks are recomputed and the
    load given up, a store is abandoned (docs/operations.md, "When a copy thread stalls")."""
    layer_wise: bool = False
    """In-step loads and stores move layer by layer through vLLM's per-layer hooks (the
    forward of layer i overlaps the copies of the other layers) where the KV cache can be
    cut per layer (kv_offload/vllm/worker/layers.py). Off by default: on vLLM CPU our copy
    threads then compete with the forward for the same cores, and host hits measured slower
    than whole-step copies (README, "Benchmarks")."""
    remote_wait_s: float = 5.0
    """Prefill/decode disaggregation: the longest a decode server's request waits for the
    blocks a prefill server promised in kv_transfer_params (then it loads what is there and
    recomputes the rest). The request waits in vLLM's queue holding no engine blocks; every
    other request keeps running."""
    storage_required: bool = False
    """Stop the engine at start-up when its storage tier cannot be reached (a wrong host
    name, a store that is down), instead of starting with host memory only until it
    answers (the default, with a warning naming the tier)."""
    find_on_lookup: str = "when_idle"
    """Whether a request's first lookup asks the storage tier itself for blocks other
    engines stored (and waits for the answer: a step or two) before it is answered:
    'when_idle' (an engine that ran no forward for 0.5 s, whose reports are stale),
    'always' (busy engines too: what others stored is found whatever the tier's refresh
    interval, and a prompt nobody stored waits a step or two more), or 'never'
    (kv_offload/vllm/scheduler/store_waits.py)."""
    model_identity: str | None = None
    """The model's identity as the operator names it (e.g. a deploy version), in place of the
    digest of every byte of its weight files: it must change whenever the weights do. Needed
    with a storage tier when the weights are not local files (a remote load); otherwise the
    content digest is used (kv_offload/vllm/weights.py)."""

    def check_engine_block_size(self, engine_block_size: int) -> int:
        """The offloaded chunk size in tokens: the engine's block size (the one rule: a
        key names one whole engine block, so any other `block_size` is refused)."""
        if self.block_size is not None and self.block_size != engine_block_size:
            raise ConfigError(
                f"block_size={self.block_size}: kv-offload moves whole engine blocks of "
                f"{engine_block_size} tokens; leave block_size unset or set it to "
                f"{engine_block_size}")
        return engine_block_size


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string like '16GiB'; names `key` on error."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be a byte size (int or e.g. '16GiB'), got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) and \
            match.group(2).lower() in _UNITS:
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        units = ", ".join(u for u in _UNITS if u)
        raise ConfigError(f"{key} must be a byte size: an int or a number with a unit "
                          f"({units}), got {value!r}")
    if number <= 0:
        raise ConfigError(f"{key} must be positive, got {value!r}")
    return number


def format_size(num_bytes: float) -> str:
    """A byte count as people read it: "512 B", "16.0 KiB", "1.5 TiB" (parse_size's inverse,
    to a tenth)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def parse_config(extra: Mapping[str, Any] | None) -> OffloadConfig:
    """Validate `kv_connector_extra_config` and build an OffloadConfig: keys, types and
    values. The choices only the store and the tiers can judge (the eviction policy's name,
    the storage tier's options, the cipher) are `startup_checks.check_config`'s."""
    extra = dict(extra or {})
    accepted = [f.name for f in fields(OffloadConfig)]
    unknown = sorted(set(extra) - set(accepted))
    if unknown:
        # (a typo names its fix: the nearest accepted key, where one is close)
        hints = [f"{key!r}: did you mean {close[0]!r}?" for key in unknown
                 if (close := difflib.get_close_matches(key, accepted, n=1, cutoff=0.75))]
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise ConfigError(f"unknown key(s) {unknown} in kv_connector_extra_config{hint}; "
                          f"accepted keys: {accepted}")
    if "cpu_bytes_to_use" not in extra:
        raise ConfigError("cpu_bytes_to_use is required (bytes of host memory for the CPU "
                          "tier, e.g. '16GiB')")
    values: dict[str, Any] = {"cpu_bytes_to_use": parse_size("cpu_bytes_to_use",
                                                             extra["cpu_bytes_to_use"])}
    root = extra.get("fs_root_dir")
    if root is not None:
        if not isinstance(root, str) or not root:
            raise ConfigError(f"fs_root_dir must be a non-empty path string, got {root!r}")
        if "fs_bytes_to_use" not in extra:
            raise ConfigError("fs_bytes_to_use is required when fs_root_dir is set "
                              "(the disk tier's budget, e.g. '100GiB')")
        values["fs_root_dir"] = os.path.abspath(os.path.expanduser(root))
    if "fs_bytes_to_use" in extra:
        if root is None:
            raise ConfigError("fs_bytes_to_use is set but fs_root_dir is not; set fs_root_dir "
                              "to enable the disk tier")
        values["fs_bytes_to_use"] = parse_size("fs_bytes_to_use", extra["fs_bytes_to_use"])
    if "in_step_load_bytes" in extra:
        budget = extra["in_step_load_bytes"]  # (0: every load asynchronous)
        values["in_step_load_bytes"] = 0 if budget in (0, "0") and budget is not False \
            else parse_size("in_step_load_bytes", budget)
    if "in_step_read_s" in extra:
        values["in_step_read_s"] = _seconds(
            "in_step_read_s", extra["in_step_read_s"], 10,
            "0: reads from the storage tier always load asynchronously")
    if "remote_wait_s" in extra:
        values["remote_wait_s"] = _seconds(
            "remote_wait_s", extra["remote_wait_s"], 600,
            "how long a decode server waits for a prefill server's blocks")
    if "find_on_lookup" in extra:
        mode = extra["find_on_lookup"]
        if mode not in ("when_idle", "always", "never"):
            raise ConfigError(f"find_on_lookup must be 'when_idle', 'always' or 'never', "
                              f"got {mode!r}")
        values["find_on_lookup"] = mode
    if "copy_timeout_s" in extra:
        seconds = extra["copy_timeout_s"]
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or \
                not 0 < seconds <= 600:
            raise ConfigError(f"copy_timeout_s must be a number of seconds above 0 and at "
                              f"most 600, got {seconds!r}")
        values["copy_timeout_s"] = float(seconds)
    if "block_size" in extra:
        block = extra["block_size"]
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ConfigError(f"block_size must be a positive int (tokens), got {block!r}")
        values["block_size"] = block
    if "eviction_policy" in extra:  # (the store's policies judge it: check_config)
        values["eviction_policy"] = extra["eviction_policy"]
    for flag in ("fs_fsync", "layer_wise", "storage_required"):
        if flag in extra:
            if not isinstance(extra[flag], bool):
                raise ConfigError(f"{flag} must be true or false, got {extra[flag]!r}")
            values[flag] = extra[flag]
    old = [key for key in OLD_DISK_KEYS if key in extra]
    if old:  # (checked above as before; storage_choice maps them to the filesystem tier)
        warnings.warn(f"{', '.join(old)}: the old spelling of the disk tier, read until "
                      f"kv-offload 0.2; write \"storage_tier\": \"filesystem\", "
                      f"\"storage_options\": {{\"root_dir\": ..., \"bytes_to_use\": ..., "
                      f"\"fsync\": ...}} instead", FutureWarning, stacklevel=2)
    values.update(_parse_storage_tier(extra))
    values.update(_parse_secret(extra))
    if "compression" in extra:
        values["compression"] = _parse_compression(extra["compression"],
                                                   values.get("storage_tier"))
    values.update(_parse_model_identity(extra))
    return OffloadConfig(**values)


def _parse_compression(name: Any, tier: str | None) -> str:
    if not isinstance(name, str) or name not in COMPRESSION_CHOICES:
        raise ConfigError(f"compression must be one of {list(COMPRESSION_CHOICES)}, "
                          f"got {name!r}")
    if name != "off" and tier is not None and tier not in BUILTIN_STORAGE_TIERS:
        raise ConfigError(f"compression: {name!r} applies to the built-in storage tiers "
                          f"{list(BUILTIN_STORAGE_TIERS)}; storage_tier {tier!r} is a plug-in, "
                          f"whose reads are sized by the page (compressed records are "
                          f"smaller): set compression to 'off'")
    return name


def _seconds(key: str, value: Any, most: float, meaning: str) -> float:
    """A number of seconds from 0 to `most`; names `key`, the range and `meaning` on error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not 0 <= value <= most:
        raise ConfigError(f"{key} must be a number of seconds from 0 to {most:g} ({meaning}), "
                          f"got {value!r}")
    return float(value)


def _parse_model_identity(extra: Mapping[str, Any]) -> dict[str, Any]:
    name = extra.get("model_identity")
    if name is None:
        return {}
    if not isinstance(name, str) or not name.strip() or len(name) > 256 or \
            not name.isprintable():
        raise ConfigError(f"model_identity must be a printable string of 1 to 256 characters "
                          f"that changes whenever the weights change (e.g. a deploy "
                          f"version), got {name!r}")
    return {"model_identity": name}


def _parse_storage_tier(extra: Mapping[str, Any]) -> dict[str, Any]:
    tier, options = extra.get("storage_tier"), extra.get("storage_options")
    if tier is None:
        if options is not None:
            raise ConfigError("storage_options is set but storage_tier is not; set "
                              "storage_tier to 'filesystem', 'valkey', 's3' or "
                              "'package.module:ClassName'")
        return {}
    if not isinstance(tier, str) or not tier:
        raise ConfigError(f"storage_tier must be a tier name or 'package.module:ClassName', "
                          f"got {tier!r}")
    if "fs_root_dir" in extra:
        raise ConfigError(f"fs_root_dir and storage_tier={tier!r} both choose the secondary "
                          f"tier; keep one (storage_tier 'filesystem' takes root_dir and "
                          f"bytes_to_use in storage_options)")
    if options is None:
        options = {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"storage_options must be a dict with string keys, got {options!r}")
    return {"storage_tier": tier, "storage_options": dict(options)}


def _parse_secret(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`secret_file` (checked now: exists, private, not empty), `encrypt` (needs it) and
    `trusted_store` (its opposite: never both). Whether the tier needs one of them is
    `startup_checks.check_config`'s to judge (it knows which tiers are shared)."""
    path, encrypt = extra.get("secret_file"), extra.get("encrypt", False)
    trusted = extra.get("trusted_store", False)
    for flag, value in (("encrypt", encrypt), ("trusted_store", trusted)):
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
    if path is None:
        if encrypt:
            raise ConfigError("encrypt: true needs secret_file (a file, mode 0600, holding "
                              "the shared secret the encryption key is derived from)")
        return {"trusted_store": trusted}
    if trusted:
        raise ConfigError("trusted_store: true and secret_file both set: with secret_file "
                          "the store is not trusted, records are authenticated; remove "
                          "trusted_store")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"secret_file must be a non-empty path string, got {path!r}")
    from kv_offload.runtime.secret_file import read_secret

    path = os.path.abspath(os.path.expanduser(path))
    read_secret(path)  # the checks only: the bytes are read again where keys are derived
    return {"secret_file": path, "encrypt": encrypt}
